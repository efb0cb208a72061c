"""Built-in methods; importing this package registers them."""

from . import dense, santa, santa_tiles  # noqa: F401
