# A tiny DRT on a few PG19 books: trains on a CPU in minutes and its loss visibly falls.
#   python prepare_pg19.py --max_books=20        # or --source /path/to/pg19 for a local copy
#   python train.py config/quickstart.py
out_dir = "out-quickstart"
eval_interval = 100
eval_iters = 5
log_interval = 10
always_save_checkpoint = False

block_size = 1008  # 16 chunks of 63
batch_size = 2
tokens_per_step = 0  # one micro-batch per step

n_embd = 128
n_head = 4
n_lower = 2
groups = (2,)
n_enc = 1
window = 256  # 4 chunks: retrieval reaches the 12 chunks the window cannot see
topk = 4

max_iters = 300
