"""Built-in methods: importing this package imports every module in it, which registers them."""

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
