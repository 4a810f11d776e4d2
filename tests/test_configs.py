"""Attention tile tables (triton_kernels/configs.py): per architecture, every entry sourced and
selected on its own architecture, plain launches unaffected by modifier-specific entries.
No compiling here (tests/test_compile.py compiles every entry)."""
import pytest

from flashtx.triton_kernels import configs
from flashtx.triton_kernels.configs import KNOWN_TARGETS, TABLES, family, select_config

FAMILY_ARCH = {"sm80": 80, "sm86": 86, "sm90": 90}
KERNELS = ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq", "attn_bwd_dq_dbias", "attn_scores")


def entries():
    for fam, kernels in TABLES.items():
        for kernel, by_elt in kernels.items():
            for elt, by_bucket in by_elt.items():
                for bucket, cfg in by_bucket.items():
                    yield fam, kernel, elt, bucket, cfg


def test_every_family_has_every_kernel_dtype_and_head_dim():
    for fam in FAMILY_ARCH:
        for kernel in KERNELS:
            for elt in (2, 4):
                # forward and backward also have 192: head dims split in two pieces (launch.head_split), e.g. 128 + 64
                buckets = {64, 128, 256} if kernel == "attn_scores" else {64, 128, 192, 256}
                assert set(TABLES[fam][kernel][elt]) == buckets, (fam, kernel, elt)


@pytest.mark.parametrize("fam,kernel,elt,bucket,cfg", list(entries()),
                         ids=lambda x: "" if hasattr(x, "block_m") else str(x))
def test_each_entry_names_its_source_and_is_what_its_architecture_selects(fam, kernel, elt, bucket, cfg):
    assert cfg.reason, "every entry names its source"
    archs = [a for a in KNOWN_TARGETS if family(a) == fam]
    for arch in archs:
        for plain in (False, True):
            assert select_config(kernel, bucket, bucket, elt, KNOWN_TARGETS[arch], not plain) == cfg, (arch, plain)


def test_sm89_shares_sm86s_tables_and_sm90_is_hopper():
    assert family(89) == family(86) == "sm86" and family(80) == "sm80" and family(90) == "sm90"


def test_fp32_large_head_dims_have_backward_configs_on_sm90():
    """Coverage: float32 D=160-256 (bucket 256) no longer falls back to the reference on an H100/H200."""
    for kernel in KERNELS:
        assert select_config(kernel, 256, 256, 4, KNOWN_TARGETS[90]) is not None
        assert select_config(kernel, 256, 256, 4, KNOWN_TARGETS[86]) is not None


def test_a_modifier_entry_never_changes_the_plain_selection(monkeypatch):
    small = configs.TileConfig(16, 16, 4, 1, "test: trimmed for score modifiers")
    monkeypatch.setitem(configs.MODIFIED, "sm90", {"attn_fwd": {2: {128: small}}})
    configs._select.cache_clear()
    try:
        assert select_config("attn_fwd", 128, 128, 2, KNOWN_TARGETS[90], True) == small
        assert select_config("attn_fwd", 128, 128, 2, KNOWN_TARGETS[90], False) == TABLES["sm90"]["attn_fwd"][2][128]
    finally:
        configs._select.cache_clear()


def test_an_unknown_small_part_falls_back_to_entries_that_fit():
    tiny = configs.Target(87, 101_376)  # e.g. a Jetson part read from the driver: sm86's tables fit
    assert select_config("attn_bwd_dkdv", 128, 128, 2, tiny) == TABLES["sm86"]["attn_bwd_dkdv"][2][128]
    with pytest.raises(RuntimeError, match="no attn_fwd config fits"):
        select_config("attn_fwd", 256, 256, 4, configs.Target(90, 10_000))
