"""Every ```python example in README.md runs, in order, in one namespace as a reader's session
would (on CUDA with a GPU; on CPU here, through the interpreter or the reference backend)."""
import re
import warnings
from pathlib import Path

from conftest import DEVICE

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_examples_run():
    assert len(BLOCKS) >= 8
    ns = {}
    for i, code in enumerate(BLOCKS):
        code = code.replace('device="cuda"', f'device="{DEVICE}"')
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # bf16 on CPU falls back to the reference with a warning
            try:
                exec(compile(code, f"README.md python block {i}", "exec"), ns)
            except Exception as exc:
                raise AssertionError(f"README python block {i} failed:\n{code}") from exc
