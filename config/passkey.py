# A small DRT trained on the synthetic passkey task alone (DESIGN §6, tasks.py): 2,016-token
# prompts (32 chunks of 63) with the key at a random depth; next-token loss everywhere (the task_loss default).
# The window (4 chunks) sees the key in ~1 prompt of 8: elsewhere the model must retrieve it.
# Learns retrieval within minutes on one GPU; then test at 1000x the length and more:
#   python train.py config/passkey.py
#   python sample.py --out_dir=out-passkey --passkey --lengths=2K,16K,128K,1M,4M,16M --offload
out_dir = "out-passkey"
dataset = "passkey"
eval_interval = 500
eval_iters = 8  # the answer loss: a few hundred answer tokens
log_interval = 50

block_size = 2016
batch_size = 32
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
max_iters = 2500
