"""bench/providers.py's handling of an xformers wheel whose C++ library did not load (built for another torch): its
build check is cleared so the decode bench can time triton_splitKF, and left alone when the library loaded; the
attention bench skips xformers then, saying why."""
import sys
import types

import pytest

from bench import providers


def _fake_xformers(monkeypatch, loaded: bool):
    mods = {name: types.ModuleType(name) for name in ("xformers", "xformers.ops", "xformers._cpp_lib",
                                                      "xformers.ops.fmha", "xformers.ops.fmha.common")}
    mods["xformers._cpp_lib"]._build_metadata = object() if loaded else None
    mods["xformers.ops.fmha.common"]._built_with_cuda = loaded
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return mods


@pytest.mark.parametrize("loaded", [False, True])
def test_the_build_check_is_cleared_only_when_the_cpp_library_did_not_load(monkeypatch, loaded):
    mods = _fake_xformers(monkeypatch, loaded)
    xops, note = providers.xformers_ops_without_cpp()
    assert xops is mods["xformers.ops"]
    assert mods["xformers.ops.fmha.common"]._built_with_cuda is True
    assert bool(note) is (not loaded) and ("did not load" in note or loaded)


def test_without_xformers_the_provider_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "xformers.ops", None)  # import raises ImportError
    with pytest.raises(providers.Unavailable, match="xformers.ops"):
        providers.xformers_ops_without_cpp()


def test_the_attention_provider_skips_xformers_without_its_cpp_library(monkeypatch):
    _fake_xformers(monkeypatch, loaded=False)
    case = providers.AttnCase(1, 2, 2, 64, 64, True, None)
    with pytest.raises(providers.Unavailable, match="C\\+\\+ library did not load"):
        providers.BUILDERS["xformers"](case)
