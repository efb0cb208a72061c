"""Built-in methods: each module registers its methods when imported; this package only declares their names.

A module is imported the first time one of its names is asked for (``kvsieve.method(name)``), so checking a
spec's name, or building one method, imports neither the other methods nor (for an unknown name) torch.
``tests/test_api.py`` checks that each module registers exactly the names declared here.
"""

import importlib
from functools import partial

from ..core.registry import declare_methods

#: module -> the method names it registers
BUILTIN = {
    "bernoulli": ("bernoulli-qk",),
    "dense": ("dense",),
    "magicpig": ("magicpig",),
    "oracle_topk": ("oracle-topk",),
    "oracle_topp": ("oracle-topp",),
    "quest": ("quest",),
    "random_sample": ("random",),
    "saap": ("saap", "saap-kmeans", "saap-kmeans-roped"),
    "santa": ("santa", "santa-strat", "santa-sys"),
    "santa_prop_flash": ("santa-prop", "santa-flash"),
    "sketchwalk": ("sketchwalk",),
    "streaming": ("streaming",),
    "vattention": ("vattention",),
}

for _module, _names in BUILTIN.items():
    declare_methods(_names, partial(importlib.import_module, f"{__name__}.{_module}"))


def load_all() -> None:
    """Import every built-in method module (registers every built-in method)."""
    for module in BUILTIN:
        importlib.import_module(f"{__name__}.{module}")
