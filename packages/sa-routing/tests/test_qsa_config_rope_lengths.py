"""QSAIndexerConfig validation, apply_qsa_rope against a complex rotation, right-padded masks and packed bounds."""

import numpy as np
import pytest
import torch

from sa_routing import QSAIndexerConfig, apply_qsa_rope, right_padded_sequence_lengths, rotary_table
from sa_routing.qsa.lengths import packed_block_starts, validate_cu_seqlens

# -- config ------------------------------------------------------------------------------------------


def test_config_defaults_match_the_reference_model():
    config = QSAIndexerConfig(hidden_size=2560)
    assert (config.indexer_n_heads, config.indexer_head_dim, config.indexer_kv_heads) == (4, 128, 1)
    assert (config.indexer_budget, config.indexer_compress_ratio) == (2048, 4)
    assert config.route_width == 2051
    assert config.dense_positions == 2051


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"indexer_kv_heads": 2}, "indexer_kv_heads must be 1"),
        ({"indexer_budget": 2047}, "divisible by"),
        ({"indexer_compress_ratio": 1}, "compress_ratio must be an int > 1"),
        ({"indexer_n_heads": 0}, "indexer_n_heads must be a positive int"),
        ({"indexer_head_dim": -4}, "indexer_head_dim must be a positive int"),
        ({"hidden_size": 0}, "hidden_size must be a positive int"),
        ({"query_chunk_size": 0}, "query_chunk_size"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ],
    ids=[
        "kv-heads-2",
        "budget-not-multiple",
        "ratio-1",
        "zero-heads",
        "negative-dim",
        "zero-hidden",
        "zero-chunk",
        "zero-eps",
    ],
)
def test_config_rejects_invalid_geometry(fields, message):
    base = {"hidden_size": 64}
    base.update(fields)
    with pytest.raises(ValueError, match=message):
        QSAIndexerConfig(**base)


# -- rope --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("head_dim", "rotary_dim"), [(24, 24), (24, 10)], ids=["full-rotary", "partial-rotary"]
)
def test_rope_rotates_half_split_pairs_like_a_complex_product(dtype, head_dim, rotary_dim):
    torch.manual_seed(0)
    states = torch.randn(2, 7, 3, head_dim).to(dtype)
    freqs = rotary_table(torch.randint(0, 5000, (2, 7)), rotary_dim)
    out = apply_qsa_rope(states, freqs)
    half = rotary_dim // 2
    pairs = torch.complex(states[..., :half].double(), states[..., half:rotary_dim].double())
    angle = torch.complex(
        freqs[..., :half].to(dtype).double(), freqs[..., half:].to(dtype).double()
    )[:, :, None]
    rotated = pairs * angle
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out[..., :half].double(), rotated.real, atol=tol, rtol=tol)
    torch.testing.assert_close(out[..., half:rotary_dim].double(), rotated.imag, atol=tol, rtol=tol)
    assert torch.equal(out[..., rotary_dim:], states[..., rotary_dim:])


@pytest.mark.parametrize(
    ("states_shape", "freqs_shape", "message"),
    [
        ((2, 7, 24), (2, 7, 8), "states must be"),
        ((2, 7, 3, 24), (2, 6, 8), r"\[batch, tokens\]"),
        ((2, 7, 3, 24), (2, 7, 7), "must be even"),
        ((2, 7, 3, 24), (2, 7, 26), "<= head_dim"),
        ((2, 7, 3, 24), (7, 8), "freqs_cis must be"),
    ],
    ids=["3d-states", "mismatched-tokens", "odd-rotary", "rotary-too-large", "2d-freqs"],
)
def test_rope_rejects_bad_shapes(states_shape, freqs_shape, message):
    with pytest.raises(ValueError, match=message):
        apply_qsa_rope(torch.randn(states_shape), torch.randn(freqs_shape))


# -- lengths -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.bool, torch.int64, torch.float32], ids=["bool", "int64", "fp32"]
)
def test_right_padded_mask_gives_row_lengths(dtype):
    mask = torch.zeros(3, 11, dtype=dtype)
    mask[0, :11] = 1
    mask[1, :4] = 1
    lengths = right_padded_sequence_lengths(mask, 3, 11, "cpu")
    assert lengths.dtype == torch.int64
    assert lengths.tolist() == [11, 4, 0]


def test_no_mask_means_full_rows():
    assert right_padded_sequence_lengths(None, 2, 9, "cpu").tolist() == [9, 9]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([[0, 0, 1, 1, 1]], "left-padded or have holes"),
        ([[1, 1, 0, 1, 0]], "left-padded or have holes"),
        ([[1, 1, 2, 2, 0]], "document-id"),
    ],
    ids=["left-padding", "interior-hole", "document-ids"],
)
def test_masks_other_than_right_padding_are_rejected(rows, message):
    with pytest.raises(ValueError, match=message):
        right_padded_sequence_lengths(torch.tensor(rows), 1, 5, "cpu")


def test_masks_of_the_wrong_shape_are_rejected():
    with pytest.raises(ValueError, match=r"\[batch, sequence\]"):
        right_padded_sequence_lengths(torch.ones(1, 1, 5, 5), 1, 5, "cpu")


def test_cu_seqlens_must_start_at_zero_and_increase():
    assert validate_cu_seqlens("op", torch.tensor([0, 3, 9]), 10) == (0, 3, 9)
    with pytest.raises(ValueError, match="strictly increasing"):
        validate_cu_seqlens("op", torch.tensor([0, 5, 5, 9]), 10)
    with pytest.raises(ValueError, match="start at 0"):
        validate_cu_seqlens("op", (1, 5), 10)
    with pytest.raises(ValueError, match="<= the"):
        validate_cu_seqlens("op", (0, 11), 10)


@pytest.mark.parametrize("bounds", [(0, 7.9, 20), ["0", "10", "20"], (0, True, 20), "0,10"])
def test_cu_seqlens_of_non_integers_are_rejected_not_truncated(bounds):
    with pytest.raises(TypeError, match="cu_seqlens must be"):
        validate_cu_seqlens("op", bounds, 20)
    as_scalars = [torch.tensor(0), np.int64(7), 20]  # integer scalars of other kinds are ints
    assert validate_cu_seqlens("op", as_scalars, 20) == (0, 7, 20)


@pytest.mark.parametrize(
    ("batch", "length", "error", "message"),
    [
        (2, -5, ValueError, "sequence_length must be >= 0"),
        (-1, 5, ValueError, "batch_size must be >= 0"),
        (2, 5.5, TypeError, "sequence_length must be an int"),
        (True, 5, TypeError, "batch_size must be an int"),
    ],
)
def test_right_padded_lengths_reject_bad_sizes(batch, length, error, message):
    with pytest.raises(error, match=message):
        right_padded_sequence_lengths(None, batch, length, "cpu")


def test_packed_blocks_restart_at_every_document():
    assert packed_block_starts((0, 5, 7, 16), 3) == (0, 1, 1, 4)
    with pytest.raises(ValueError, match="strictly increasing"):
        packed_block_starts((0, 8, 4), 2)
    with pytest.raises(ValueError, match="compress_ratio must be an int >= 1"):
        packed_block_starts((0, 4, 8), 0)
