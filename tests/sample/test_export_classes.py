"""The exported DiTPipeline works with its defaults for a model of any class count up to 1000 (issue #34):
DiTPipeline guides against class id 1000, so the label table is padded to 1001 rows with the null row at 1000;
more than 1000 classes is refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.sample import ExportConfig, export
from dit_pipeline.sample.export import build_diffusers_transformer, set_dit_timestep_frequencies
from tests.sample.conftest import LATENT, our_checkpoint, random_dit


def test_a_ten_class_pipeline_samples_with_its_default_guidance(tmp_path, tiny_vae_dir):
    from diffusers import DiTPipeline

    ema = random_dit(32, num_classes=10)
    ckpt = tmp_path / "ten.pt"
    torch.save(our_checkpoint(random_dit(31, num_classes=10), ema, latent=LATENT), ckpt)
    out = export(ExportConfig(to="diffusers", output=str(tmp_path / "pipe"), ckpt=str(ckpt), vae=str(tiny_vae_dir)))
    pipe = DiTPipeline.from_pretrained(out)
    table = pipe.transformer.transformer_blocks[0].norm1.emb.class_embedder.embedding_table.weight
    ours = ema.state_dict()["y_embedder.embedding_table.weight"]
    assert table.shape == (1001, ours.shape[1])
    assert torch.equal(table[:10], ours[:10]) and torch.equal(table[1000], ours[10])  # the null row at 1000
    # before: IndexError (index 1000 of an 11-row table) on the default call (guidance_scale 4)
    images = pipe(class_labels=[3, 9], num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                  output_type="np").images
    assert images.shape[0] == 2 and np.isfinite(images).all()
    # the pipeline's null class is the model's: the transformer at id 1000 is the DiT at its null id 10
    set_dit_timestep_frequencies(pipe.transformer)
    x, t = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([3, 700])
    with torch.no_grad():
        theirs = pipe.transformer(x, timestep=t, class_labels=torch.tensor([1000, 9])).sample
        torch.testing.assert_close(theirs, ema(x, t, torch.tensor([10, 9])), rtol=1e-5, atol=1e-5)


def test_more_than_1000_classes_is_refused_for_the_pipeline(tmp_path, tiny_vae_dir):
    model = random_dit(3, num_classes=1001)
    assert build_diffusers_transformer(model.state_dict(), model.config).config.num_embeds_ada_norm == 1001
    ckpt = tmp_path / "big.pt"
    torch.save(our_checkpoint(model, model), ckpt)
    with pytest.raises(UserError) as e:
        export(ExportConfig(to="diffusers", output=str(tmp_path / "pipe"), ckpt=str(ckpt), vae=str(tiny_vae_dir)))
    assert str(e.value) == ("--to diffusers: this model has 1001 classes, but DiTPipeline guides against class id "
                            "1000 as its null class, which is one of this model's classes; export it with --to "
                            "safetensors and sample with dit-sample")
    assert not (tmp_path / "pipe").exists()
