"""bench/host_profile.py runs (on CPU: its smoke mode, the interpreter at tiny shapes; the times mean
nothing) and reports a row per provider and pass, so the GPU step cannot rot unseen."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `import bench`

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is for machines without a GPU")


def test_host_profile_reports_each_provider_and_pass(tmp_path, capsys):
    from bench import host_profile

    out = tmp_path / "hp.json"
    assert host_profile.main(["--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| flashtx | fwd |" in text and "| flashtx | bwd |" in text
    import json
    rows = json.loads(out.read_text())
    assert {(r["provider"], r["pass"]) for r in rows} >= {("flashtx", "fwd"), ("flashtx", "bwd")}
    assert all(r["total_us"] >= r["host_call_us"] > 0 for r in rows)
