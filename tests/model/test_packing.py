"""Packed sequences (vit_explorer.model.packing): several sequences of different lengths run as
one pass give what each gives alone, for a class-token model and rotary ones (each sequence's
patches rotated by their own rows, its prefix tokens not at all)."""
import pytest
import torch

import vit_explorer as vx
from vit_explorer.model.packing import Packing
from vit_explorer.model.recorder import Recorder, recording
from helpers import randomize, tiny_config
from rotary import ROTARY, rotary_model


def _model(family):
    return randomize(vx.ViT(tiny_config(image_size=16))) if family is None else rotary_model(family)


@pytest.mark.parametrize("family", [None, *ROTARY])
def test_packed_sequences_give_what_each_gives_alone(family):
    model = _model(family)
    grid, prefix = model.grid_size(), model.num_prefix_tokens
    x = torch.randn(1, 3, *model.config.img_size, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        whole = model.norm_pre(model._pos_embed(model.patch_embed(x)))  # (1, N, D)
        tables = model.rope_tables(grid)
        # Three runs: two sets of 5 patches, one of 9, one of none.
        indices = [torch.stack([torch.randperm(grid[0] * grid[1], generator=generator)[:k].sort().values
                                for _ in range(count)]) for count, k in ((2, 5), (1, 9), (1, 0))]
        runs = [torch.cat([whole[:, :prefix].expand(len(index), -1, -1), whole[0, prefix:][index]], dim=1)
                for index in indices]
        packing = Packing.of(runs)
        assert packing.runs == ((2, prefix + 5), (1, prefix + 9), (1, prefix))
        rope = None if tables is None else packing.rope(prefix, [(tables[0][i], tables[1][i]) for i in indices])
        packed = packing.unpack(model.forward_blocks(packing.tokens, grid_size=grid, rope=rope, packing=packing))
        for tokens, index, out in zip(runs, indices, packed):
            alone = model.forward_blocks(
                tokens, grid_size=grid, rope=None if tables is None else (tables[0][index][:, None], tables[1][index][:, None])
            )
            torch.testing.assert_close(out, alone, atol=1e-5, rtol=1e-5)


def test_a_recorder_does_not_take_packed_sequences():
    model = _model(None)
    packing = Packing.of([torch.randn(2, 3, model.config.embed_dim)])
    with recording(Recorder(model, layers=[0])), pytest.raises(ValueError, match="packed sequences"):
        model.forward_blocks(packing.tokens, packing=packing)
