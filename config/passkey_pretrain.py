# Stage 1 of the long-context recipe (the paper's Appendix D: NIAH models are fine-tuned from PG19
# checkpoints): a small DRT learns language on PG19, and copying from rows of random tokens.
#   python train.py config/passkey_pretrain.py        # then config/passkey_finetune.py
# Answering by a name (multi-key) builds on copying, which 116M tokens of 24 books do not teach:
# half the rows are a random span repeated to the row's end, within the window or past its reach
# (tasks.copy_row). Without the spans past the reach, the multi-key fine-tune stays at <= 30%.
# d=256, 2 lower + 2 upper layers, a 1-layer chunk encoder, top-4 retrieval. Prompts of 1,008
# tokens (16 chunks) are twice the reach of the stacked windows (4 layers x 128 positions):
# trained on prompts the windows cover, retrieval learns a position shortcut and fails at
# longer contexts; at twice the reach it must retrieve by content, and that generalizes.
out_dir = "out-passkey-pretrain"
dataset = "pg19"
eval_interval = 600
eval_iters = 8
log_interval = 100

block_size = 1008  # 16 chunks of 63 tokens
batch_size = 64
tokens_per_step = 0  # one micro-batch per step

n_embd = 256
n_head = 4  # head width 64: FlashGCA's tile
n_lower = 2
groups = (2,)
n_enc = 1
window = 128  # 2 chunks; 4 layers reach 512 positions, half the prompt
topk = 4

learning_rate = 2e-3
min_lr = 2e-4
warmup_frac = 0.05
max_iters = 1500
copy_frac = 0.5  # half the rows random tokens to copy, near and past the windows (tasks.copy_row)
seed = 0  # the README reports seeds 0, 1, 2 (--seed=N for both stages)
