"""
The retriever's teachers in training: what train.py adds to the paper, whose DRT learns retrieval from the next-token
loss alone. Both are departures, each set by the config files that need it (their comments say why):

  teacher_picks   for the first teacher_iters steps GCA reads chunks a teacher found, not Eq. 1's picks
                  (config/code_teacher.py, config/passkey_finetune.py); per_hop splits them by the needles' groups
                  (teacher_hops, config/twohop.py)
  needle_loss     a cross-entropy on Eq. 1's scores that ranks the asked needle first (needle_loss,
                  config/passkey_finetune.py), from the queries and landmarks DRT.recording() holds

Not run on its own.
"""

import math

import torch
import torch.nn.functional as F

from model import cdiv, read_shift, upcast


def teacher_picks(idx, cfg, slots=0):
    """What GCA reads while step < teacher_iters. For landmark t of idx (B, L): the K chunks before chunk t
    that share the most token ids, weighted by idf, with chunk t+1, the chunk that reads them.
    It peeks at the text the read serves, so it exists in training only. Why: a read path fed chunks
    that do not help never learns to copy from them, and Eq. 1 cannot learn to find chunks a read path
    ignores; handed useful chunks first, GCA learns to use them (dev/LOG.md has the runs). Eq. 3 still
    weighs the chunks with the model's scores. -> (B, n, K) chunk ids as Eq. 1's picks, -1 where
    fewer than K are readable (then Eq. 1 picks). slots=n: the n best alone, in the last n slots: Eq. 1 keeps its
    K-n best, the chunks its scores must learn to rank below the teacher's."""
    T, V, K = cfg.chunk_size - 1, cfg.vocab_size, cfg.topk
    B, L = idx.shape
    n, nc = L // T, cdiv(L, T)  # landmarks (complete chunks), chunks
    x = F.pad(idx, (0, (nc + 1) * T - L), value=V).view(B, nc + 1, T)  # the last landmark's t+1: empty
    bag = torch.zeros(B, nc + 1, V + 1, device=idx.device, dtype=torch.bfloat16).scatter_(2, x, 1.0)[..., :V]  # (B, nc + 1, V)
    idf = torch.log((nc + 1) / (bag.float().sum(1, keepdim=True) + 1)).to(bag.dtype)  # (B, 1, V): rare ids count
    score = torch.einsum("btv,brv->btr", bag[:, 1 : n + 1] * idf, bag[:, :n]).float()  # (B, n, n): chunk t+1 . chunk r
    t, r = torch.arange(n, device=idx.device)[:, None], torch.arange(n, device=idx.device)
    first = read_shift(cfg)  # GCA reads chunk j + first for a pick j: under code_read, chunk 0 is never read
    score = score.masked_fill((r < first) | (r >= t), float("-inf"))  # chunks before t (t itself: the window's)
    best, read = score.topk(min(K, n), -1)  # (B, n, K)
    picks = (read - first).masked_fill(best == float("-inf"), -1)
    picks = F.pad(picks, (0, K - picks.size(-1)), value=-1)
    keep = slots or K  # the teacher's best `keep`, in the last slots; -1 (Eq. 1's own) before them
    return torch.cat([torch.full_like(picks[..., keep:], -1), picks[..., :keep]], -1)


def per_hop(picks, labels):
    """teacher_hops: picks (B, n, K) -> (B, G, n, K), each group's: at a landmark where some group has a needle label
    (tasks.needle_labels (B, G, n)) the teacher's chunks go to the labelled groups alone, the others pick by Eq. 1
    (-1). In a 2-hop row group 1 then reads "VAR X = 12345." only if it finds it, so the answer must come through
    group 2."""
    labelled = labels >= 0  # (B, G, n)
    keep = labelled | ~labelled.any(1, keepdim=True)
    return picks[:, None].masked_fill(~keep[..., None], -1)


def needle_loss(record, labels):
    """train.py's needle ranking loss of a training forward run under DRT.recording(): needle_rank_loss of each group's
    Eq. 1 (its ("eq1", q, l) entries, in group order) against its labels (B, G, n) of tasks.needle_labels, summed."""
    eq1 = [r[1:] for r in record if r[0] == "eq1"]
    return sum(needle_rank_loss(q, l, labels[:, g]) for g, (q, l) in enumerate(eq1))


def needle_rank_loss(q, l, needles):
    """The cross-entropy of Eq. 1's scores that each labelled landmark ranks its needle first among the batch's chunks,
    a pressure that outlasts the answer's loss, which fades once Eq. 3 weighs the needle enough to copy it. q (B, n, C) the landmarks' queries, l (B, n, C) the chunks' landmarks, needles (B, n):
    the chunk to rank first (< its landmark), -1 for none; a row labels one landmark at most. Rivals: the row's
    chunks before the landmark, and other rows' chunks before their labelled landmark; the needle's neighbours,
    which may hold part of it, are left out in every row."""
    B, n, C = q.shape
    s = (upcast(q).flatten(0, 1) @ upcast(l).flatten(0, 1).T / math.sqrt(C)).view(B, n, B, n)  # fp32
    j = torch.arange(n, device=q.device)
    labelled = needles >= 0  # (B, n)
    t_row = (labelled * j).amax(1)  # (B,) each row's labelled landmark (0: none, so no chunk before it)
    need_row = needles.amax(1)  # (B,) its needle, -1: none
    away = (j - need_row[:, None]).abs() != 1  # (B, n) not a neighbour of the row's needle
    other = (j < t_row[:, None]) & away & (j != need_row[:, None])  # (B, n) chunks other rows may rank
    own = (j[None, :] < j[:, None])[None] & away[:, None, :]  # (B, n, n) the row's earlier chunks
    same = torch.eye(B, dtype=torch.bool, device=q.device)[:, None, :, None]  # (B, 1, B, 1)
    valid = torch.where(same, own[:, :, None, :], other[None, None])  # (B, n, B, n)
    valid = valid | ~labelled[:, :, None, None]  # unlabelled landmarks: ignored, but kept finite
    target = torch.where(labelled, torch.arange(B, device=q.device)[:, None] * n + needles, -1)  # (B, n)
    return F.cross_entropy(s.masked_fill(~valid, float("-inf")).view(B * n, B * n), target.view(-1),
                           ignore_index=-1, reduction="sum") / labelled.sum().clamp(min=1)
