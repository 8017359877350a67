"""iMF as the release defines it (dit/imf.py, dit/meanflow.py variant "imf"), against the release's own code written
out in tests/dit/_imf_reference.py (Lyy-iiis/imeanflow models/imfDiT.py, imf.py; its torch branch's file layout):
the network's u and v, its files (the PyTorch branch's .pth, the flax tree as .npz), its loss with both heads and
the first-k label dropout, and its gradients; our earlier iMF variant (imf-adaln) and its files still load."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.dit.imf import from_flax_params
from dit_pipeline.dit.meanflow import MeanFlow, MeanFlowLoop, time_input
from tests._util import FP32_EPS, assert_close_at_scale
from tests.dit import _imf_reference as R

TINY = dict(hidden=32, heads=2, patch=2, channels=4, num_classes=5)


def _ours(tree, shared, head_depth, v_head=True):
    m = dit.create_model("iMF-B/2", input_size=8, depth=shared + head_depth, head_depth=head_depth, hidden_size=32,
                         num_heads=2, num_classes=5, v_head=v_head)
    m.load_state_dict(from_flax_params(R.flatten({"net": tree})), strict=True)
    return m.eval()  # training mode would drop labels at random from the global RNG (another test's state)


def _inputs(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, 8, 8, generator=g, dtype=torch.float64)
    t = torch.tensor([0.9, 0.5, 0.3], dtype=torch.float64)[:n]
    h = torch.tensor([0.4, 0.0, 0.2], dtype=torch.float64)[:n]
    w = torch.tensor([3.0, 1.0, 6.0], dtype=torch.float64)[:n]
    lo, hi = torch.tensor([0.1, 0.0, 0.3], dtype=torch.float64)[:n], torch.tensor([0.7, 1.0, 0.6], dtype=torch.float64)[:n]
    return x, (t, h, w, lo, hi), torch.tensor([0, 5, 3])[:n]  # 5: the null class


def _nchw(a):
    return a.permute(0, 3, 1, 2)


def test_the_network_is_the_releases_u_and_v_and_sees_h_not_t():
    tree = R.random_tree(np.random.default_rng(0), shared=1, head_depth=2, **TINY)
    m = _ours(tree, 1, 2)
    x, (t, h, w, lo, hi), y = _inputs()
    u_ref, v_ref = R.imf_dit(R.to_torch(tree), x.permute(0, 2, 3, 1), t, h, w, lo, hi, y, heads=2, patch=2)
    tin = torch.stack([t, h, w, lo, hi], dim=1).float()
    with torch.no_grad():
        uv = m(x.float(), tin, y, heads="uv")
        other_t = m(x.float(), torch.stack([t * 0.5, h, w, lo, hi], dim=1).float(), y, heads="uv")
    assert_close_at_scale(uv[:, :4], _nchw(u_ref), rel=8 * FP32_EPS, what="u")
    assert_close_at_scale(uv[:, 4:], _nchw(v_ref), rel=8 * FP32_EPS, what="v")
    # imfDiT.py 342: conditioned on h only (another t: the same values, to the rounding of another memory layout)
    assert_close_at_scale(other_t, uv, rel=4 * FP32_EPS, what="another t")
    with torch.no_grad():  # one head alone: the same values as both together
        assert_close_at_scale(m(x.float(), tin, y), uv[:, :4], rel=4 * FP32_EPS, what="u alone")
        assert_close_at_scale(m(x.float(), tin, y, heads="v"), uv[:, 4:], rel=4 * FP32_EPS, what="v alone")
    assert m.config["conditions"] == "imf" and m.config["family"] == "iMF" and len(m.blocks) == 5
    assert list(m.state_dict()) == list(dit.model_from_config(m.config).state_dict())
    with pytest.raises(ValueError, match="no v heads"):
        _ours({k: v for k, v in tree.items() if not k.startswith("v_heads")}, 1, 2, v_head=False)(
            x.float(), tin, y, heads="v")


def test_presets_and_initialisation_are_the_releases():
    """imfDiT.py 393-427 and the inits of torch_models.py / embedder.py: the final layers and residual scales zero
    (u = v = 0 at start), block weights normal(0.32 / sqrt(fan_in)), embedder weights normal(1 / sqrt(fan_in)),
    tokens and labels normal(1 / sqrt(D))."""
    sizes = {"iMF-B/2": (12, 768, 12, 8), "iMF-M/2": (24, 768, 12, 8), "iMF-L/2": (32, 1024, 16, 8),
             "iMF-XL/2": (48, 1024, 16, 8)}
    for name, (depth, hidden, heads, head) in sizes.items():
        with torch.device("meta"):
            m = dit.create_model(name)
        assert (m.depth, m.hidden_size, m.num_heads, m.head_depth, m.prefix) == (depth, hidden, heads, head, 20)
        assert m.blocks[0].mlp.w1.out_features == int(hidden * 8 / 3)
    assert dit.family.lookup_preset("imfDiT_XL_2")[1] == "iMF-XL/2" == dit.family.lookup_preset("MiT_XL_2")[1]
    torch.manual_seed(0)
    m = dit.create_model("iMF-B/2", input_size=8, depth=3, head_depth=1, hidden_size=256, num_heads=4, num_classes=10)
    blk = m.shared_blocks[0]
    assert blk.attn.q_proj.weight.std().item() == pytest.approx(0.32 / 16, rel=0.05)
    assert blk.mlp.w2.weight.std().item() == pytest.approx(0.32 / math.sqrt(int(256 * 8 / 3)), rel=0.05)
    assert m.h_embedder.mlp[0].weight.std().item() == pytest.approx(1 / 16, rel=0.05)
    assert m.class_tokens.std().item() == pytest.approx(1 / 16, rel=0.1)
    assert m.y_embedder.embedding_table.weight.std().item() == pytest.approx(1 / 16, rel=0.1)
    zero = [blk.attn_scale, blk.mlp_scale, m.u_final_layer.linear.weight, m.v_final_layer.linear.bias]
    assert all(not p.any() for p in zero) and not m.h_embedder.mlp[0].bias.any()
    x = torch.randn(2, 4, 8, 8)
    assert not m(x, time_input("imf", *torch.rand(5, 2)), torch.tensor([1, 2]), heads="uv").any()


def test_the_releases_files_load(tmp_path):
    """Its PyTorch branch's inference .pth (the v heads removed, as its convert.py writes them) and its JAX
    TrainState's trees flattened to .npz (EMA preferred) load as iMF models with the release's objective."""
    rng = np.random.default_rng(1)
    tree, ema = (R.random_tree(rng, shared=1, head_depth=2, **TINY) for _ in range(2))
    x, (t, h, w, lo, hi), y = _inputs()
    tin = torch.stack([t, h, w, lo, hi], dim=1).float()
    torch.save(R.torch_branch_state_dict(tree), tmp_path / "iMF-B-2.pth")
    with pytest.raises(dit.WeightsError, match="no position table, so its latent size is unknown; pass --input-size"):
        dit.load_dit_weights(tmp_path / "iMF-B-2.pth")  # not a preset's size: the release's 32 is not assumed
    sd, info = dit.load_dit_weights(tmp_path / "iMF-B-2.pth", hints={"input_size": 8})
    assert (info["family"], info["objective"], info["release"], info["model_config"]["v_head"]) == \
        ("iMF", "imf", "iMF", False)
    # the latents it was trained on (utils/vae_util.py 40-60): sd-vae-ft-mse, (z - mean) / std per channel
    norm = info["latent"]["normalization"]
    assert (norm["form"], norm["mean"][0], norm["std"][3], info["latent"]["vae"]["source"]) == \
        ("mean_std", 0.86488, 3.9870003, "stabilityai/sd-vae-ft-mse")
    u_ref, _ = R.imf_dit(R.to_torch(tree), x.permute(0, 2, 3, 1), t, h, w, lo, hi, y, heads=2, patch=2)
    model = dit.build_model_from_weights(sd, info)
    with torch.no_grad():
        assert_close_at_scale(model(x.float(), tin, y), _nchw(u_ref), rel=8 * FP32_EPS, what="u from the .pth")
    state = {**{f"params/{k}": v for k, v in R.flatten({"net": tree}).items()},
             **{f"ema_params/{k}": v for k, v in R.flatten({"net": ema}).items()}, "step": np.array(7)}
    np.savez(tmp_path / "imf.npz", **state)
    for prefer, which in (("ema", ema), ("model", tree)):
        sd, info = dit.load_dit_weights(tmp_path / "imf.npz", prefer=prefer, hints={"input_size": 8})
        assert (info["weights"], info["source"], info["objective"], info["model_config"]["v_head"]) == \
            (prefer, "imf-flax", "imf", True)
        model = dit.build_model_from_weights(sd, info)
        u_ref, v_ref = R.imf_dit(R.to_torch(which), x.permute(0, 2, 3, 1), t, h, w, lo, hi, y, heads=2, patch=2)
        with torch.no_grad():
            assert_close_at_scale(model(x.float(), tin, y, heads="v"), _nchw(v_ref), rel=8 * FP32_EPS, what="v")


def _release_batch(n=6, seed=3):
    """The release's draws for one batch (imf.py sample_tr 126-139, sample_cfg_interval 163-179, sample_cfg_scale
    141-161 with cfg_beta 1, s_max 7), from explicit random numbers."""
    g = torch.Generator().manual_seed(seed)
    x, e = (torch.randn(n, 4, 8, 8, generator=g, dtype=torch.float64) for _ in range(2))
    a, b = (torch.sigmoid(torch.randn(n, generator=g, dtype=torch.float64) - 0.4) for _ in range(2))
    t, r = torch.maximum(a, b), torch.minimum(a, b)
    fm = torch.arange(n) < int(n * 0.5)
    r = torch.where(fm, t, r)
    lo = torch.where(fm, 0.0, torch.rand(n, generator=g, dtype=torch.float64) * 0.5)
    hi = torch.where(fm, 1.0, 0.5 + torch.rand(n, generator=g, dtype=torch.float64) * 0.5)
    omega = torch.exp(torch.rand(n, generator=g, dtype=torch.float64) * math.log1p(7.0))
    return x, e, t, r, fm, lo, hi, omega


def test_the_loss_and_its_gradients_are_the_releases():
    """imf.py forward (331-401): guidance from the v head (guidance_fn 295-325), the FIRST k labels dropped
    (cond_drop 263-293; here draws 2 and 4 fall below 0.1, so samples 1 and 2 lose theirs), the JVP along v_c,
    loss_u + loss_v each adaptively weighted; our loss per sample, its mean and every parameter's gradient equal."""
    tree = R.random_tree(np.random.default_rng(0), shared=1, head_depth=1, **TINY)
    m = _ours(tree, 1, 1)
    x, e, t, r, fm, lo, hi, omega = _release_batch()
    y = torch.tensor([0, 1, 2, 3, 4, 1])
    u = torch.tensor([0.5, 0.05, 0.7, 0.02, 0.9, 0.3], dtype=torch.float64)
    params = R.to_torch(tree, requires_grad=True)
    ref, monitors = R.imf_loss(params, x.permute(0, 2, 3, 1), y, t, r, fm, e.permute(0, 2, 3, 1), lo, hi, omega, u,
                               heads=2, patch=2, num_classes=5)
    ref.backward()
    grads = from_flax_params({k: v.grad.numpy() for k, v in R.flatten(params).items()})  # the layout, not values
    imf = MeanFlow(variant="imf")
    imf.attach(m)
    drop = imf.drop_labels((u < 0.1).long())  # what the trainer passes: its draws below the probability
    assert drop.tolist() == [1, 1, 0, 0, 0, 0]
    tr = torch.stack([t, r, omega, lo, hi], dim=1).float()
    ours = imf.training_losses(m, x.float(), tr, {"y": y, "force_drop_ids": drop}, noise=e.float())
    ours["loss"].mean().backward()
    assert_close_at_scale(ours["loss"].mean(), ref, rel=16 * FP32_EPS, what="loss")
    assert_close_at_scale(ours["mse"].mean(), monitors["loss_u"], rel=16 * FP32_EPS, what="loss_u")
    assert_close_at_scale(ours["mse_v"].mean(), monitors["loss_v"], rel=16 * FP32_EPS, what="loss_v")
    scale = max(g.abs().max().item() for g in grads.values())
    assert scale > 1e-3 and set(grads) == {k for k, _ in m.named_parameters()}
    for name, p in m.named_parameters():
        assert_close_at_scale(p.grad, grads[name], rel=64 * FP32_EPS, scale=scale, what=name)


def test_label_dropout_is_the_releases_first_k_and_ours_per_sample():
    """imf.py cond_drop (263-293): k = #(u < p) draws, and the FIRST k samples get the null class (so only r = t
    samples lose theirs); imf-adaln, this project's variant, keeps the trainer's per-sample draws."""
    draws = torch.tensor([0, 0, 1, 0, 1, 0, 0, 1])
    assert MeanFlow(variant="imf").drop_labels(draws).tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert MeanFlow(variant="imf-adaln").drop_labels(draws).tolist() == draws.tolist()


def _adaln_imf_model():
    torch.manual_seed(0)
    return dit.create_model("DiT-S/2", input_size=8, depth=2, hidden_size=32, num_heads=2, learn_sigma=False,
                            num_classes=5, conditions="imf")


def test_our_imf_variant_is_named_and_its_old_files_load(tmp_path):
    """Files of this project's iMF written before the release's network (objective "imf" on a DiT with embedders
    added) read back as imf-adaln and sample; the release's objective refuses networks other than its own."""
    from dit_pipeline.dit.formats import CHECKPOINT_FORMAT, CHECKPOINT_VERSION
    from dit_pipeline.dit.objectives import network_problem

    m = _adaln_imf_model()
    sd = m.state_dict()
    old = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "model": sd, "ema": sd,
           "model_config": m.config, "objective": "imf", "step": 3,
           "meanflow": {"mf_omega": 1.0, "mf_kappa": 0.0, "mf_s_max": 7.0}}
    torch.save(old, tmp_path / "step-0000003.pt")
    loaded, info = dit.load_dit_weights(tmp_path / "step-0000003.pt")
    assert (info["objective"], info["model_config"]["conditions"], info["family"]) == ("imf-adaln", "imf", "DiT")
    model = dit.build_model_from_weights(loaded, info)
    z = torch.randn(2, 4, 8, 8)
    out = MeanFlowLoop(1).bind("imf", 4.0)(lambda a, b, c: model(a, b, c), z, torch.tensor([0, 1]))
    assert out.shape == z.shape and torch.isfinite(out).all()
    assert "imf-adaln" in network_problem("imf", "DiT") and "--model iMF-B/2" in network_problem("imf", "DiT")
    assert "trains with --objective imf" in network_problem("imf-adaln", "iMF")
    assert network_problem("imf-adaln", "LightningDiT") is None and network_problem("imf", "iMF") is None
    with pytest.raises(TypeError):  # the release's objective asks for the v head, which an adaLN network has not
        imf = MeanFlow(variant="imf")
        imf.attach(m)
        imf.training_losses(m, z, imf.draw_timesteps(2), {"y": torch.tensor([0, 1]), "force_drop_ids": None})
