"""common.teacher: the DINOv2 teacher of REPA, on tiny random ViTs of the same family (timm's DINOv2 models at
width 32, depth 2, patch 14) saved in Meta's and in timm's key layout, so every loading path runs.

Parity on CPU float32: the preprocessing against the formula written out here (including bicubic
interpolation), Meta vs timm layouts (identical features), the position table against timm's
resample_abs_pos_embed, and the features against a float64 DINOv2 forward written out here from Meta's names.
"""
from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dit_pipeline.common import teacher as T
from dit_pipeline.common.errors import UserError
from tests._util import FP32_EPS, assert_close_at_scale

SOURCE_GRID = 6   # the tiny file's own table (the real files have 37 x 37 at 518 px)
GRID = 4          # what the tests load it at (56 px)
TINY = {"embed_dim": 32, "depth": 2, "num_heads": 2}


@pytest.fixture
def tiny_archs(monkeypatch):
    monkeypatch.setitem(T.TEACHERS, "tiny", T.TeacherArch("vit_base_patch14_dinov2", "tiny_pretrain.pth",
                                                          "timm/tiny-dinov2", label="tiny DINOv2",
                                                          overrides=TINY))
    monkeypatch.setitem(T.TEACHERS, "tiny_reg", T.TeacherArch("vit_base_patch14_reg4_dinov2", "tiny_reg4_pretrain.pth",
                                                              "timm/tiny-dinov2-reg", registers=4,
                                                              label="tiny DINOv2 with registers", overrides=TINY))


def meta_state_dict(registers: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tiny weights in Meta's DINOv2 names (layer scales and tokens of order 1, so every part counts)."""
    import timm

    torch.manual_seed(seed)
    name = "vit_base_patch14_reg4_dinov2" if registers else "vit_base_patch14_dinov2"
    model = timm.create_model(name, pretrained=False, num_classes=0, img_size=14 * SOURCE_GRID, **TINY)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(seed + 1)
    for k in sd:
        if k.endswith("gamma") or k in ("cls_token", "reg_token") or k.endswith("bias"):
            sd[k] = torch.randn(sd[k].shape, generator=g) * 0.5
    sd["mask_token"] = torch.zeros(1, 32)
    if registers:  # Meta keeps the class position in pos_embed and names the registers register_tokens
        sd["register_tokens"] = sd.pop("reg_token")
        sd["pos_embed"] = torch.cat([torch.randn(1, 1, 32, generator=g), sd["pos_embed"]], dim=1)
    return sd


def timm_state_dict(meta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights in timm's layout, converted here by the published rule (timm's _convert_dinov2)."""
    sd = {k: v.clone() for k, v in meta.items() if k != "mask_token"}
    if "register_tokens" in sd:
        sd["reg_token"] = sd.pop("register_tokens")
        sd["cls_token"] = sd["cls_token"] + sd["pos_embed"][:, :1]
        sd["pos_embed"] = sd["pos_embed"][:, 1:]
    return sd


@pytest.fixture
def files(tmp_path, tiny_archs):
    out = {}
    for registers in (0, 4):
        meta = meta_state_dict(registers)
        out[registers, "meta"] = tmp_path / f"meta{registers}.pth"
        torch.save(meta, out[registers, "meta"])
        out[registers, "timm"] = tmp_path / f"timm{registers}.pth"
        torch.save(timm_state_dict(meta), out[registers, "timm"])
        out[registers, "safetensors"] = tmp_path / f"timm{registers}.safetensors"
        save_file(timm_state_dict(meta), str(out[registers, "safetensors"]))
    return out


def images(n: int = 2, size: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# ---- the formulas, written out ---------------------------------------------------------------------------------

def _cubic(x: float, a: float = -0.75) -> float:
    x = abs(x)
    if x <= 1:
        return (a + 2) * x ** 3 - (a + 3) * x ** 2 + 1
    if x < 2:
        return a * x ** 3 - 5 * a * x ** 2 + 8 * a * x - 4 * a
    return 0.0


def _bicubic_matrix(n_in: int, n_out: int) -> torch.Tensor:
    """[n_out, n_in] weights of 1-D bicubic resampling, half-pixel centres (align_corners=False), edge clamped."""
    m = torch.zeros(n_out, n_in, dtype=torch.float64)
    scale = n_in / n_out
    for o in range(n_out):
        src = (o + 0.5) * scale - 0.5
        base = math.floor(src)
        for k in range(base - 1, base + 3):
            m[o, min(max(k, 0), n_in - 1)] += _cubic(src - k)
    return m


def formula_preprocess(pixels_nhwc: torch.Tensor, size: int) -> torch.Tensor:
    x = pixels_nhwc.double().permute(0, 3, 1, 2) / 255.0
    mean = torch.tensor([0.485, 0.456, 0.406], dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], dtype=torch.float64).view(1, 3, 1, 1)
    x = (x - mean) / std
    rows, cols = _bicubic_matrix(x.shape[2], size), _bicubic_matrix(x.shape[3], size)
    return torch.einsum("oh,nchw,pw->ncop", rows, x, cols)


def formula_dinov2(meta: dict[str, torch.Tensor], x: torch.Tensor, grid: int, heads: int = 2) -> torch.Tensor:
    """DINOv2's forward (Meta's names) in float64 -> x_norm_patchtokens [N, grid^2, D]: patch tokens, class token
    first and both plus their positions, register tokens after the class token, pre-norm blocks with layer scale,
    final norm. The position table is the file's, resampled as REPA does (timm's resample_abs_pos_embed)."""
    from timm.layers import resample_abs_pos_embed

    sd = {k: v.double() for k, v in meta.items()}
    n, d = x.shape[0], sd["cls_token"].shape[-1]
    pos = resample_abs_pos_embed(meta["pos_embed"], new_size=[grid, grid], num_prefix_tokens=1).double()
    w = sd["patch_embed.proj.weight"].reshape(d, -1)
    patches = x.double().unfold(2, 14, 14).unfold(3, 14, 14)  # [N, 3, g, g, 14, 14]
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(n, grid * grid, -1)
    tok = torch.cat([sd["cls_token"].expand(n, 1, d), patches @ w.T + sd["patch_embed.proj.bias"]], dim=1) + pos
    if "register_tokens" in sd:
        tok = torch.cat([tok[:, :1], sd["register_tokens"].expand(n, -1, d), tok[:, 1:]], dim=1)

    def ln(v, name):
        mu = v.mean(-1, keepdim=True)
        var = ((v - mu) ** 2).mean(-1, keepdim=True)
        return (v - mu) / torch.sqrt(var + 1e-6) * sd[name + ".weight"] + sd[name + ".bias"]

    def lin(v, name):
        return v @ sd[name + ".weight"].T + sd[name + ".bias"]

    hd = d // heads
    for b in range(len({k.split(".")[1] for k in sd if k.startswith("blocks.")})):
        p = f"blocks.{b}."
        qkv = lin(ln(tok, p + "norm1"), p + "attn.qkv")
        outs = []
        for h in range(heads):
            q, k, v = (qkv[..., j * d + h * hd: j * d + (h + 1) * hd] for j in range(3))
            outs.append(torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd), dim=-1) @ v)
        tok = tok + sd[p + "ls1.gamma"] * lin(torch.cat(outs, dim=-1), p + "attn.proj")
        hid = lin(ln(tok, p + "norm2"), p + "mlp.fc1")
        hid = 0.5 * hid * (1 + torch.erf(hid / math.sqrt(2)))  # exact GELU
        tok = tok + sd[p + "ls2.gamma"] * lin(hid, p + "mlp.fc2")
    skip = 1 + (sd["register_tokens"].shape[1] if "register_tokens" in sd else 0)
    return ln(tok, "norm")[:, skip:]


# ---- tests ---------------------------------------------------------------------------------------------------

def test_preprocessing_is_the_formula_for_both_layouts(files):
    teacher = T.load_teacher(str(files[0, "meta"]), grid=GRID)
    assert teacher.image_size == 56 and teacher.num_tokens == 16 and teacher.dim == 32
    px = images()
    want = formula_preprocess(px, 56)
    got = teacher.preprocess(px)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 56, 56)
    assert_close_at_scale(got, want, rel=64 * FP32_EPS)
    assert torch.equal(teacher.preprocess(px.permute(0, 3, 1, 2)), got)  # [N, 3, H, W] too
    with pytest.raises(ValueError, match=r"uint8 images \[N, H, W, 3\] or \[N, 3, H, W\], got torch.float32"):
        teacher.preprocess(px.float())


@pytest.mark.parametrize("registers", [0, 4])
def test_meta_and_timm_layouts_give_identical_features_and_dinov2s_values(files, registers):
    px = images(3)
    feats = {}
    for layout in ("meta", "timm", "safetensors"):
        teacher = T.load_teacher(str(files[registers, layout]), grid=GRID)
        assert teacher.identity["name"] == ("tiny_reg" if registers else "tiny")
        assert teacher.identity["layout"] == ("meta" if layout == "meta" else "timm")
        feats[layout] = teacher(px)
    assert feats["meta"].shape == (3, 16, 32) and feats["meta"].dtype == torch.float32
    assert torch.equal(feats["meta"], feats["timm"]) and torch.equal(feats["meta"], feats["safetensors"])
    meta = torch.load(files[registers, "meta"], weights_only=True)
    want = formula_dinov2(meta, formula_preprocess(px, 56), GRID)
    assert_close_at_scale(feats["meta"], want, rel=1e-5)


@pytest.mark.parametrize("registers", [0, 4])
def test_position_table_is_timms_resampling_of_the_files(files, registers):
    from timm.layers import resample_abs_pos_embed

    meta = torch.load(files[registers, "meta"], weights_only=True)
    model = T.load_teacher(str(files[registers, "meta"]), grid=GRID).model
    pos = meta["pos_embed"]
    assert pos.shape == (1, 1 + SOURCE_GRID ** 2, 32)
    if registers:  # the class position moves into cls_token; the patch positions are resampled alone
        assert torch.equal(model.cls_token, meta["cls_token"] + pos[:, :1])
        assert torch.equal(model.reg_token, meta["register_tokens"])
        assert torch.equal(model.pos_embed, resample_abs_pos_embed(pos[:, 1:], [GRID, GRID], num_prefix_tokens=0))
    else:
        assert torch.equal(model.pos_embed, resample_abs_pos_embed(pos, [GRID, GRID], num_prefix_tokens=1))
        assert torch.equal(model.pos_embed[:, :1], pos[:, :1])
    assert model.pos_embed.shape[1] - (0 if registers else 1) == GRID * GRID


def test_frozen_eval_no_grad_and_no_global_random_numbers(files):
    state = torch.random.get_rng_state()
    teacher = T.load_teacher(str(files[0, "timm"]), grid=GRID)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert not teacher.model.training
    assert not any(p.requires_grad for p in teacher.model.parameters())
    with torch.enable_grad():
        out = teacher(images())
    assert not out.requires_grad
    assert teacher.autocast_dtype is None  # bf16 on CUDA only
    assert teacher.identity["weights_sha256"] and teacher.identity["kind"] == "file"
    teacher.check_tokens(16)
    with pytest.raises(UserError, match=r"gives 16 tokens per image \(4x4 at 56 px\) but the DiT has 256"):
        teacher.check_tokens(256)


def test_torch_hub_cache_and_offline_errors(files, tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(hub))
    monkeypatch.setattr(T, "_unreachable", lambda url: "https://dl.fbaipublicfiles.com is unreachable: no route")
    with pytest.raises(UserError) as e:
        T.load_teacher("tiny", grid=GRID)
    assert str(e.value) == (
        f"--repa tiny: {hub}/checkpoints/tiny_pretrain.pth is missing (torch.hub's cache) and "
        "https://dl.fbaipublicfiles.com is unreachable: no route. Download "
        "https://dl.fbaipublicfiles.com/dinov2/dinov2_vitb14/tiny_pretrain.pth there where there is a network, or "
        "pass the file itself (--repa /path/tiny_pretrain.pth) or timm's copy (timm/tiny-dinov2)")
    import urllib.error

    monkeypatch.setattr(T, "_unreachable", lambda url: None)
    fetched = []

    def refuse(url, dst, progress=True):
        fetched.append(url)
        raise urllib.error.URLError("403 Forbidden")

    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    with pytest.raises(UserError, match=r"downloading https://dl.fbaipublicfiles.com/dinov2/dinov2_vitb14/"
                                        r"tiny_pretrain.pth failed \(URLError: <urlopen error 403 Forbidden>\)"):
        T.load_teacher("tiny", grid=GRID)
    monkeypatch.setattr(torch.hub, "download_url_to_file",
                        lambda url, dst, progress=True: (fetched.append(url), Path(dst).write_bytes(
                            files[0, "meta"].read_bytes())))
    teacher = T.load_teacher("tiny", grid=GRID)  # fetched into the cache, then read from it
    assert (hub / "checkpoints" / "tiny_pretrain.pth").is_file() and len(fetched) == 2
    teacher = T.load_teacher("tiny", grid=GRID)
    assert len(fetched) == 2
    assert teacher.identity["kind"] == "torch-hub" and teacher.identity["layout"] == "meta"
    assert torch.equal(teacher(images()), T.load_teacher(str(files[0, "meta"]), grid=GRID)(images()))


def test_hub_id_from_the_cache_or_one_clear_error(files, tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hf"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as e:
        T.load_teacher("timm/tiny-dinov2", grid=GRID)
    assert str(e.value).startswith(f"--repa 'timm/tiny-dinov2': no local file of that name, and model.safetensors "
                                   f"is not in the Hugging Face cache ({cache}) and the hub was not asked "
                                   "(HF_HUB_OFFLINE is set).")
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = cache / "models--timm--tiny-dinov2" / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "model.safetensors").write_bytes(files[0, "safetensors"].read_bytes())
    (cache / "models--timm--tiny-dinov2" / "refs").mkdir()
    (cache / "models--timm--tiny-dinov2" / "refs" / "main").write_text(commit)
    teacher = T.load_teacher("timm/tiny-dinov2", grid=GRID)
    assert (teacher.identity["kind"], teacher.identity["commit"]) == ("hub", commit)
    assert torch.equal(teacher(images()), T.load_teacher(str(files[0, "meta"]), grid=GRID)(images()))


def test_other_architectures_and_bad_files_are_refused(files, tmp_path, monkeypatch):
    with monkeypatch.context() as m:  # the real table only: the tiny ViT is not a ViT-B
        m.delitem(T.TEACHERS, "tiny")
        m.delitem(T.TEACHERS, "tiny_reg")
        with pytest.raises(UserError, match=r"meta0.pth: a ViT of width 32, 2 blocks, patch 14, not DINOv2 ViT-B/14 "
                                            r"\(missing \['blocks.10.attn.proj.bias', .*; shape mismatch "
                                            r"\['cls_token: \[1, 1, 32\] vs \[1, 1, 768\]', .*nothing was loaded$"):
            T.load_teacher(str(files[0, "meta"]), grid=GRID)
        with pytest.raises(UserError, match="not DINOv2 ViT-B/14 with 4 registers"):
            T.load_teacher(str(files[4, "timm"]), grid=GRID)
    dit_file = tmp_path / "dit.pt"
    torch.save({"pos_embed": torch.zeros(1, 4, 8), "x_embedder.proj.weight": torch.zeros(8, 4, 2, 2)}, dit_file)
    with pytest.raises(UserError, match=r"not a ViT state_dict \(no patch_embed.proj.weight; keys start with "
                                        r"\['pos_embed', 'x_embedder.proj.weight'\]\); expected one of: dinov2_vitb14"):
        T.load_teacher(str(dit_file), grid=GRID)
    sd = torch.load(files[0, "timm"], weights_only=True)
    del sd["blocks.1.ls2.gamma"]
    torch.save(sd, tmp_path / "partial.pth")
    with pytest.raises(UserError, match=r"missing \['blocks.1.ls2.gamma'\]\); nothing was loaded"):
        T.load_teacher(str(tmp_path / "partial.pth"), grid=GRID)
    evil = tmp_path / "evil.pth"
    evil.write_bytes(pickle.dumps(pickle.Unpickler, protocol=2))  # a GLOBAL that weights_only refuses
    with pytest.raises(UserError, match="cannot read .*evil.pth as weights"):
        T.load_teacher(str(evil), grid=GRID)
    with pytest.raises(UserError, match=r"--repa 'nope.pth': no such file"):
        T.load_teacher("nope.pth", grid=GRID)
    (tmp_path / "weights").mkdir()
    with pytest.raises(UserError) as e:
        T.load_teacher(str(tmp_path / "weights"), grid=GRID)
    assert str(e.value) == (f"--repa '{tmp_path / 'weights'}': {tmp_path / 'weights'} is a folder; pass the weights "
                            "file in it (Meta's dinov2_vitb14_pretrain.pth or timm's model.safetensors)")
    with pytest.raises(ValueError, match="grid must be a positive integer"):
        T.load_teacher(str(files[0, "timm"]), grid=0)


def test_the_real_architectures_build_at_256_and_512_px():
    for key, grid, shapes in (("dinov2_vitb14", 16, {"pos_embed": (1, 257, 768), "cls_token": (1, 1, 768)}),
                              ("dinov2_vitb14", 32, {"pos_embed": (1, 1025, 768)}),
                              ("dinov2_vitb14_reg", 16, {"pos_embed": (1, 256, 768), "reg_token": (1, 4, 768)})):
        model = T._build(T.TEACHERS[key], grid)
        sd = model.state_dict()
        assert {k: tuple(sd[k].shape) for k in shapes} == shapes
        assert len([k for k in sd if k.startswith("blocks.") and k.endswith("attn.qkv.weight")]) == 12
        assert tuple(sd["blocks.0.mlp.fc1.weight"].shape) == (3072, 768) and "blocks.0.ls1.gamma" in sd
        assert model.patch_embed.img_size == (14 * grid, 14 * grid)
