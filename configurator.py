"""
train.py's configurator. The hyperparameters (train.py's block and DRTConfig's fields) are changed
by config files (Python, run in order), then by --key=value: a Python literal, or a bare word for a
string; --groups=3,3 or --groups="()" for a tuple. Each value must have its default's type (an int
passes for a float, a list for a tuple); a typo in a key is an error, never a new key. check_config
then checks each value's range (train.py checks what needs the data or a checkpoint).

    python train.py config/quickstart.py --batch_size=4 --groups=3,3
    python train.py --help      # every key, its default and why
"""

import ast
import dataclasses
import difflib
import inspect
import os
import runpy
import types


# the read path's four departures, one switch now (code_read): their values in the paper's form, then in the code
# recipe's; the command line names them, common.upgrade maps a checkpoint's
MERGED = ({"gca_sink": True, "center_memory": False, "read_next": False, "pool_tokens": False},
          {"gca_sink": False, "center_memory": True, "read_next": True, "pool_tokens": True})


class ConfigError(Exception):
    """A mistake in the command, a config file, the data or out_dir: printed in one line, no traceback."""


def keys_of(namespace, config_class):
    """-> ({key: default}, {key: type}) of a module's lower-case globals of plain types (train.py's
    block) and of a dataclass's fields (their annotated types: None may stand for an int)."""
    plain = (bool, int, float, str, tuple)
    defaults = {k: v for k, v in namespace.items() if k.islower() and not k.startswith("_") and isinstance(v, plain)}
    kinds = {k: type(v) for k, v in defaults.items()}
    for f in dataclasses.fields(config_class):
        defaults[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
        kinds[f.name] = f.type
    return defaults, kinds


def configure(argv, defaults, kinds):
    """Apply argv (config files and --key=value, in order) to defaults -> (config dict, the keys given)."""
    config, given = dict(defaults), set()
    for arg in argv:
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            if not eq:
                raise ConfigError(f"{arg}: write overrides as --key=value")
            try:
                updates = {key: text if kinds.get(key) is str else ast.literal_eval(text)}
            except (ValueError, SyntaxError):
                updates = {key: text}  # a bare word: a string
        elif os.path.isfile(arg):
            try:
                ran = runpy.run_path(arg)
            except Exception as e:  # a syntax error, a name error, ...: the file's fault, in one line
                raise ConfigError(f"config file {arg} does not run ({type(e).__name__}: {e}): fix it") from None
            updates = {k: v for k, v in ran.items() if not k.startswith("_") and not isinstance(v, types.ModuleType)}
        else:
            raise ConfigError(f"config file {arg} not found (overrides are written --key=value)")
        for k, v in updates.items():
            if k in MERGED[0]:
                raise ConfigError(f"{arg}: {k} is no key now: {', '.join(MERGED[0])} are one switch, code_read (True: "
                                  f"all four, as config/code_teacher.py had them)")
            if k not in defaults:
                close = difflib.get_close_matches(k, defaults, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(f"{arg}: unknown key {k!r}{hint}; python train.py --help lists the keys")
            want = kinds[k]
            if want is float and type(v) is int or want is tuple and isinstance(v, list):
                v = want(v)
            if type(v) is not want and not (v is None and defaults[k] is None):
                raise ConfigError(f"{arg}: {k} must be of type {want.__name__} like its default {defaults[k]!r}, "
                                  f"got {v!r} ({type(v).__name__})")
            config[k] = v
            given.add(k)
    return config, given


def print_help(doc, path, config_class):
    """doc, the hyperparameter block of the file at path (between its two '# ---- ' lines), and the
    fields of config_class as its source writes them: each key's default and why, from its one home."""
    with open(path, encoding="utf-8") as f:
        block = f.read().split("\n# ---- ")[1]
    fields = inspect.getsource(config_class).split("\n    def ")[0].rstrip()  # the class up to its first method
    print(f"{doc.strip()}\n\n# ---- {block}\n# the model's keys (--n_embd=256 ...), model.py:\n{fields}")


def is_tasks(dataset):
    """Whether train.py's --dataset is a comma list of synthetic tasks (tasks.TRAINED), not a prepared text dataset."""
    import tasks  # here, not above: tasks imports common, which imports this module
    return all(t in tasks.TRAINED for t in dataset.split(","))


def check_config(config):
    """The ranges of train.py's values (configure checked their types): every problem, in one line."""
    import tasks
    c = types.SimpleNamespace(**config)
    positive = ("batch_size", "block_size", "max_iters", "eval_interval", "log_interval", "eval_iters", "ddp_timeout")
    bad = [f"{k}={config[k]} must be a positive int" for k in positive if config[k] < 1]
    bad += [f"{k}={config[k]} must be >= 0" for k in ("learning_rate", "tokens_per_step", "grad_clip", "task_min_depth",
                                                      "weight_decay", "needle_loss") if config[k] < 0]
    bad += [f"{k}={config[k]} must lie in [0, 1]" for k in ("copy_frac", "task_haystack_frac")
            if not 0 <= config[k] <= 1]
    bad += [why for wrong, why in [
        (c.max_iters >= 1 and not 0 <= c.stop_iter <= c.max_iters, f"stop_iter={c.stop_iter} must lie in [0, max_iters={c.max_iters}]"),
        (c.teacher_iters < 0 or c.max_iters >= 1 and c.teacher_iters > c.max_iters,
         f"teacher_iters={c.teacher_iters} must lie in [0, max_iters={c.max_iters}]"),
        (not 0 <= c.warmup_frac < 1, f"warmup_frac={c.warmup_frac} must lie in [0, 1)"),
        (len(c.betas) != 2 or not all(0 <= b < 1 for b in c.betas), f"betas={c.betas} must be two numbers in [0, 1)"),
        (c.learning_rate >= 0 and not 0 <= c.min_lr <= c.learning_rate,
         f"min_lr={c.min_lr} must lie in [0, learning_rate={c.learning_rate}]"),
        (c.copy_frac and is_tasks(c.dataset),
         f"copy_frac mixes rows into a text dataset; --dataset={c.dataset} is synthetic tasks"),
        ("," in c.dataset and not is_tasks(c.dataset),
         f"dataset={c.dataset!r}: a comma list is of synthetic tasks, each one of {', '.join(tasks.TRAINED)}"),
        (tasks.parse_range(c.task_keys, 2, 16) is None, f"task_keys={c.task_keys!r} must be N or A-B, 2 <= A <= B <= 16"),
        (tasks.parse_range(c.task_chains, 2, 16) is None,
         f"task_chains={c.task_chains!r} must be N or A-B, 2 <= A <= B <= 16"),
        (not set(c.task_templates.split(",")) <= tasks.TEMPLATES.keys(),
         f"task_templates={c.task_templates!r} must be a comma list of {', '.join(tasks.TEMPLATES)}"),
        (c.dtype not in ("auto", "bfloat16", "float32"), f"dtype={c.dtype!r} must be one of auto, bfloat16, float32"),
        (c.device not in ("auto", "cpu", "cuda") and not (c.device[:5] == "cuda:" and c.device[5:].isdigit()),
         f"device={c.device!r} must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ] if wrong]
    if bad:
        raise ConfigError("; ".join(bad))
