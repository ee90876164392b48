# Laid over config/code_lm.py: the form of DRT whose retrieval beats random picks on code, with a teacher first.
#   python train.py config/code_lm.py config/code_teacher.py     # two such runs share one H200 in ~10 minutes
# For the first teacher_iters steps GCA reads, for each chunk, the earlier chunks that share the most
# rare tokens with the chunk after it (teacher.teacher_picks): the read path learns to copy from
# chunks that help. Then Eq. 1 picks alone: past 4K its picks are 6.6-8.5% better than random ones in
# every run (the README's code table). Evaluation (evaluate.py --ppl, --inspect) always uses Eq. 1.
out_dir = "out-code-teacher"
max_iters = 4000  # 262M tokens
eval_interval = 500
teacher_iters = 3000
# Half code_lm.py's peak rate. At 2e-3 the same command landed anywhere in 3.60-4.01 overall (twins parted
# within the teacher's steps); at 1e-3 four runs (seeds 0 and 1, each twice) all gave 3.53-3.54.
learning_rate = 1e-3
min_lr = 1e-4

# The four departures of the read path, one switch (model.py's DRTConfig): the runs in which GCA first copied on
# code used them together; with the paper's read path, handed the right chunks, it did not copy (dev/LOG.md).
#   no zero sink key in GCA: its heads rested on it and read nothing
#   chunk-centred memory: otherwise every chunk's keys share one direction and GCA cannot copy
#   a pick j read as chunk j+1, the text that followed what the query resembles
#   Eq. 1 on chunks' mean token embeddings (centred): landmark states share one direction
code_read = True
# The paper's scoring switched off, as in every run of the table. With the teacher, turning either back
# on (one run each) stayed within the recipe's spread, so neither is shown to matter here.
softmax_off_by_one = False  # Eq. 3 as a plain softmax
gumbel = False  # no noise on Eq. 1's scores
