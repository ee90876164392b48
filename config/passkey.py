# A small DRT trained on the synthetic passkey task alone (DESIGN §6, tasks.py): prompts of
# 504 tokens (8 chunks of 63) with the key at a random depth, loss on the answer only. The
# window (4 chunks) misses the key about half the time: then only retrieval can answer.
# Short training prompts on purpose: with few chunks to choose from, the retriever finds the
# key's chunk often enough to learn from it (at 32-65 chunks it did not learn in 3000 steps).
# Known weak (README, Results): the answer loss drops in 2 runs of 3, and the retriever learns
# the shortcut "pick the oldest chunks", so accuracy falls with length (90% at 504, 10% at 16K).
# Untested on a GPU: prompts twice the reach of the windows (toy_retrieval.py), e.g. --window=128
# --block_size=1008 --batch_size=64 --task_min_depth=256. Test at 1000x the length and more:
#   python train.py config/passkey.py
#   python sample.py --out_dir=out-passkey --passkey --lengths=2K,16K,128K,1M,4M,16M --offload
out_dir = "out-passkey"
dataset = "passkey"
task_loss = "answer"
eval_interval = 300
eval_iters = 4
log_interval = 100

block_size = 504
batch_size = 128
tokens_per_step = 0  # one micro-batch per step

n_embd = 256
n_head = 4  # head width 64
n_lower = 2
groups = (2,)
n_enc = 1
window = 256
topk = 4

learning_rate = 2e-3
min_lr = 2e-4
warmup_frac = 0.05
max_iters = 3200
