"""bench/test_attention_variants.py's `flashtx-plain-tiles` provider: inside plain_tiles() selection ignores
configs.py's specialisation tiles (MASKED, MODIFIED, the bias-gradient dQ's), and everything is restored after."""
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
