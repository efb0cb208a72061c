"""Help formatting shared by the subcommands."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless the default is empty (None, False, "") or the
    help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is argparse.SUPPRESS or default is None or default is False
                or default == "" or "default" in text):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"
