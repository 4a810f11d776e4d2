"""bench/test_attention_variants.py's `flashtx-plain-tiles` provider: inside plain_tiles() selection ignores
configs.py's specialisation tiles (MASKED, MODIFIED, the bias-gradient dQ's), and everything is restored after;
each variant's ideal fraction of the causal work."""
import pytest

from flashtx.triton_kernels import configs
from flashtx.triton_kernels.configs import KNOWN_TARGETS, TABLES, select_config


def test_plain_tiles_turns_the_specialisation_tables_off_and_restores_them():
    from bench.test_attention_variants import plain_tiles

    t86, t90 = KNOWN_TARGETS[86], KNOWN_TARGETS[90]
    def chosen():
        return [select_config("attn_fwd", 64, 64, 2, t86, True, True),
                select_config("attn_fwd", 64, 64, 2, t86, False, True),
                select_config("attn_bwd_dq_dbias", 128, 128, 2, t90, True)]

    before = chosen()
    assert before[0] == configs.MODIFIED["sm86"]["attn_fwd"][2][64] != TABLES["sm86"]["attn_fwd"][2][64]
    with plain_tiles():
        assert select_config("attn_fwd", 64, 64, 2, t86, True, True) == TABLES["sm86"]["attn_fwd"][2][64]
        assert select_config("attn_fwd", 64, 64, 2, t86, False, True) == TABLES["sm86"]["attn_fwd"][2][64]
        assert select_config("attn_bwd_dq_dbias", 128, 128, 2, t90, True) == TABLES["sm90"]["attn_bwd_dq"][2][128]
    assert chosen() == before


def test_plain_bwd_tiles_turn_the_specialisation_tables_off_for_the_backward_only():
    """flashtx-plain-bwd-tiles: the forward keeps MODIFIED's tile, the backward's kernels (the bias-gradient dQ
    included) take the plain ones; all restored after."""
    from bench.test_attention_variants import BWD_KERNELS, plain_tiles

    t90 = KNOWN_TARGETS[90]
    kernels = ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq_dbias")
    before = [select_config(k, 128, 128, 2, t90, True) for k in kernels]
    assert before[0] == configs.MODIFIED["sm90"]["attn_fwd"][2][128]
    assert before[1] == configs.MODIFIED["sm90"]["attn_bwd_dkdv"][2][128] != TABLES["sm90"]["attn_bwd_dkdv"][2][128]
    with plain_tiles(BWD_KERNELS):
        assert [select_config(k, 128, 128, 2, t90, True) for k in kernels] == [
            before[0], TABLES["sm90"]["attn_bwd_dkdv"][2][128], TABLES["sm90"]["attn_bwd_dq"][2][128]]
    assert [select_config(k, 128, 128, 2, t90, True) for k in kernels] == before


def _pairs(n, window=None):
    """Brute force: causal (query, key) pairs of an N x N attention, the diagonal as half (FlashAttention's N**2/2)."""
    return sum(min(i + 1, n if window is None else window + 1) - 0.5 for i in range(n))


def test_variants_record_their_ideal_fraction_of_the_causal_work():
    """Each variant's record carries the fraction of the full causal run's (query, key) pairs it computes, which the
    report prints beside the measured time ratio. The window of 1024 at N = 4096 is 0.44 of the causal work, not
    'about a quarter' as the docstring said (each query sees at most 1025 keys); varlen 16 x 1k is 0.25."""
    import bench.test_attention_variants as tv

    n, w = tv.N, tv.WINDOW
    assert tv.ideal_fraction("window1024") == pytest.approx(_pairs(n, w) / _pairs(n), rel=1e-12)
    assert tv.ideal_fraction("varlen16x1k") == pytest.approx((n // tv.DOC) * _pairs(tv.DOC) / _pairs(n), rel=1e-12)
    assert {tv.ideal_fraction(v) for v in ("full", "bias", "boolmask", "softcap+alibi", "dropout0.1")} == {1.0}
    if n == 4096:  # the recorded size (a smoke run shrinks N)
        assert round(tv.ideal_fraction("window1024"), 2) == 0.44 and tv.ideal_fraction("varlen16x1k") == 0.25
    assert "about a quarter of the causal work" not in tv.__doc__ and "0.44 of the causal work" in tv.__doc__
    # the report computes the same from the variant's name for a JSON written before the field existed
    from bench.report_targets import variant_ideal
    assert variant_ideal("window1024", 4096) == pytest.approx(_pairs(4096, 1024) / _pairs(4096))
    assert variant_ideal("varlen16x1k", 4096) == 0.25 and variant_ideal("bias", 4096) == 1.0
    assert variant_ideal("window1024", 4096, {"ideal_fraction": 0.5}) == 0.5


def test_flex_attention_missing_is_unavailable_not_a_crash(monkeypatch):
    """A torch without FlexAttention skips that provider with its reason (an inner `import torch._dynamo` made
    `torch` local, so the reason's f-string raised UnboundLocalError instead)."""
    import sys

    import torch

    from bench import providers

    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention", None)
    with pytest.raises(providers.Unavailable, match="has no FlexAttention"):
        providers._flex(providers.AttnCase(1, 2, 2, 64, 64, True, torch.float32))
