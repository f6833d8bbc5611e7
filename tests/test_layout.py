"""StageLayout: where each layer lives, the even and uneven splits, the conversions both ways,
and the errors that name the field and the numbers."""

from __future__ import annotations

import numpy as np
import pytest

from jaxmeg.pipeline.layout import PADDING, LayoutError, StageLayout


def test_even_interleaved_placement_is_megatrons():
    layout = StageLayout.create(8, num_stages=2, num_chunks=2)
    assert layout.shape == (2, 2, 2) and not layout.uneven
    # virtual stage c p + s holds layers (c p + s) Lc ..: chunk 1 of stage 0 is virtual stage 2.
    assert layout.place(4) == (0, 1, 0)
    assert layout.place(7) == (1, 1, 1)
    assert layout.layer_index[1, 0].tolist() == [4, 5]


def test_uneven_stages_pad_the_short_stage_at_its_end():
    layout = StageLayout.create(8, num_stages=2, stage_layers=[5, 3])
    assert layout.uneven and layout.shape == (1, 2, 5)
    assert layout.layer_index.tolist() == [[[0, 1, 2, 3, 4], [5, 6, 7, PADDING, PADDING]]]
    assert layout.chunk_layers.tolist() == [[5, 3]]
    assert layout.place(5) == (1, 0, 0)
    assert "[5, 3]" in layout.describe()


@pytest.mark.parametrize("stage_layers", [(), (4, 4), (5, 3), (1, 3, 2, 2)])
def test_conversions_round_trip_and_zero_the_padding(stage_layers):
    stages = len(stage_layers) or 2
    layout = StageLayout.create(8, num_stages=stages, stage_layers=stage_layers)
    canonical = np.arange(8 * 3, dtype=np.float32).reshape(8, 3) + 1
    staged = layout.to_stages(canonical)
    assert staged.shape == (*layout.shape, 3)
    np.testing.assert_array_equal(staged[layout.layer_index == PADDING], 0)
    for layer in range(8):
        s, c, pos = layout.place(layer)
        np.testing.assert_array_equal(staged[c, s, pos], canonical[layer])
    np.testing.assert_array_equal(layout.to_canonical(staged), canonical)


def test_explicit_even_counts_are_the_even_layout():
    assert not StageLayout.create(8, 2, stage_layers=(4, 4)).uneven


@pytest.mark.parametrize(
    "args,message",
    [
        ((8, 2, 1, (5, 4)), r"parallel.stage_layers \[5, 4\] sums to 9, but model.layers is 8"),
        ((8, 2, 1, (8, 0)), r"entries must be >= 1, got \[8, 0\] \(stage 1 has 0\)"),
        ((8, 2, 1, (-1, 9)), r"entries must be >= 1, got \[-1, 9\]"),
        ((8, 2, 1, (4, 2, 2)), r"has 3 entries \[4, 2, 2\], but parallel.pipe is 2"),
        ((8, 2, 2, (4, 4)), r"needs one chunk per stage .* parallel.chunks = 2"),
        ((12, 4, 2, ()), r"model.layers \(12\) must be divisible by .* = 4 \* 2 = 8"),
    ],
)
def test_bad_splits_name_the_field_and_numbers(args, message):
    with pytest.raises(LayoutError, match=message):
        StageLayout.create(*args)
