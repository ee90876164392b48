"""
train.py's configurator. The hyperparameters (train.py's block and DRTConfig's fields) are changed
by config files (Python, run in order), then by --key=value: a Python literal, or a bare word for a
string; --groups=3,3 or --groups="()" for a tuple. Each value must have its default's type (an int
passes for a float, a list for a tuple); a typo in a key is an error, never a new key.

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
