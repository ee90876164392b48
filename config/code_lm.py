# Language modelling on Linux C code (prepare_code.py), the shape of the README's code table: a
# 33M DRT, 3 lower + 3 upper layers, a 1-layer chunk encoder, top-4 of 130 chunks per 8,190-token row
# (6 layers x 256 positions reach 1,536: most of a row lies past the windows, where only retrieval reads).
#   python prepare_code.py --source linux/usr/src/linux-source-6.12.tar.xz
#   python train.py config/code_lm.py                              # ~5 minutes on one H200
#   python train.py config/code_lm.py --n_lower=7 --groups="()"    # the sliding-window baseline, 31.7M
#   python train.py config/code_lm.py --n_lower=7 --groups="()" --window=8320  # full attention over the row: the ceiling
out_dir = "out-code"
dataset = "code"
eval_interval = 300
eval_iters = 4
log_interval = 50

block_size = 8190  # 130 chunks of 63
batch_size = 8
tokens_per_step = 0  # one micro-batch per step: 65,520 tokens

n_embd = 384
n_head = 6  # head width 64: FlashGCA's tile
n_lower = 3
groups = (3,)
n_enc = 1
window = 256
topk = 4

learning_rate = 2e-3
min_lr = 2e-4
warmup_frac = 0.05
max_iters = 1200  # 79M tokens
seed = 0
