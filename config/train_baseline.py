# The sliding-window baseline LM matching config/train_drt146m.py: the same 12 decoder layers
# (window 512) with no retrieval groups and no chunk encoder, the same data, steps and optimizer,
# so the two runs' val losses compare DRT's retrieval alone (the paper, 350M: 14.55 vs 14.05 ppl).
#   torchrun --standalone --nproc_per_node=8 train.py config/train_baseline.py
out_dir = "out-baseline"
dataset = "pg19"
batch_size = 4
block_size = 16380
tokens_per_step = 524160
max_iters = 60000
n_lower = 12
groups = ()
