"""The conditioning registry (dit/conditioning.py): the trainer's model inputs of a batch with the dropout mask, the
null condition and the CFG batch of each kind. Caption dropout replaces features AND mask of the dropped rows by the
empty prompt's, as NanoGen's apply_cfg_dropout does (End2End-Diffusion/diffusion-bench src/stage2/utils.py 52-57,
transcribed below); a class batch gives exactly what the trainer gave before the registry."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dit_pipeline.dit.conditioning import ClassLabels, NoCondition, TextTokens, conditioning_of
from dit_pipeline.dit.family import create_model
from dit_pipeline.dit.flow import create_flow
from tests._util import assert_close_at_scale

CPU = torch.device("cpu")


def nanogen_cfg_dropout(model_conds, model_conds_null, mask):  # src/stage2/utils.py 52-57, the mask given
    return {k: torch.where(mask.view(-1, *([1] * (v.ndim - 1))), model_conds_null[k], v) if v is not None else None
            for k, v in model_conds.items()}


def test_class_labels_give_the_trainers_old_inputs():
    cond = conditioning_of({"num_classes": 10, "class_dropout_prob": 0.1})
    assert isinstance(cond, ClassLabels) and cond.can_guide and cond.model_config() == {}
    batch = SimpleNamespace(labels=torch.tensor([3, 7]))
    drop = torch.tensor([0, 1])
    kw = cond.batch_kwargs(batch, drop, CPU)
    assert kw.keys() == {"y", "force_drop_ids"} and kw["y"].tolist() == [3, 7] and kw["force_drop_ids"] is drop
    assert cond.batch_kwargs(batch, None, CPU)["force_drop_ids"] is None
    assert cond.concat(kw, cond.null(kw))["y"].tolist() == [3, 7, 10, 10]
    assert not conditioning_of({"num_classes": 10, "class_dropout_prob": 0.0}).can_guide


def test_caption_dropout_replaces_features_and_mask_as_nanogen():
    g = torch.Generator().manual_seed(0)
    null_text, null_mask = torch.randn(4, 6, generator=g), torch.tensor([True, False, False, False])
    cond = TextTokens(6, null_text, null_mask)
    text = torch.randn(3, 4, 6, generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    drop = torch.tensor([1, 0, 1])
    got = cond.batch_kwargs(SimpleNamespace(text=text, text_mask=mask), drop, CPU)
    want = nanogen_cfg_dropout({"context": text, "attn_mask": mask},
                               {"context": null_text.expand(3, -1, -1), "attn_mask": null_mask.expand(3, -1)},
                               drop.bool())
    assert torch.equal(got["text"], want["context"]) and torch.equal(got["text_mask"], want["attn_mask"])
    assert cond.model_config() == {"conditioning": "text", "text_dim": 6}


def test_text_of_other_lengths_is_padded_and_masked():
    cond = TextTokens(2, torch.zeros(0, 2), torch.zeros(0, dtype=torch.bool))  # Qwen3's "" has no token
    text, mask = torch.ones(2, 3, 2), torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    kw = cond.batch_kwargs(SimpleNamespace(text=text, text_mask=mask), torch.tensor([0, 1]), CPU)
    assert kw["text_mask"].tolist() == [[True, True, False], [False, False, False]]
    assert kw["text"][1].abs().sum() == 0 and torch.equal(kw["text"][0], text[0])
    both = cond.concat({"text": torch.ones(1, 1, 2), "text_mask": torch.ones(1, 1, dtype=torch.bool)}, kw)
    assert both["text"].shape == (3, 3, 2) and both["text_mask"].tolist()[0] == [True, False, False]
    with pytest.raises(ValueError, match=r"text features must be \[N, L, 2\]"):
        cond.batch_kwargs(SimpleNamespace(text=torch.ones(2, 3, 5), text_mask=mask), None, CPU)
    with pytest.raises(ValueError, match="no null condition"):
        TextTokens(2).batch_kwargs(SimpleNamespace(text=text, text_mask=mask), torch.tensor([1, 0]), CPU)
    with pytest.raises(ValueError, match="unconditional model has no null"):
        NoCondition().null({})


def test_a_text_models_loss_sees_the_empty_prompt_where_dropped():
    """The flow loss of an in-context text model on a hand-built text batch: a dropped row's loss is the one of the
    empty prompt's features, the kept rows' their own, and the gradient reaches the text projection."""
    torch.manual_seed(0)
    model = create_model("ddt-en28d1152hd72-dn2d2048hd128", input_size=4, depth=1, hidden_size=32, num_heads=2,
                         head_depth=1, head_hidden_size=32, head_num_heads=2, conditioning="text", text_dim=6,
                         num_c_tokens=5)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    null_text, null_mask = torch.randn(2, 6, generator=g), torch.tensor([True, False])
    cond = model.conditioning(null_text, null_mask)
    batch = SimpleNamespace(text=torch.randn(2, 5, 6, generator=g), text_mask=torch.ones(2, 5, dtype=torch.bool))
    x, t, noise = torch.randn(2, 4, 4, 4, generator=g), torch.rand(2, generator=g), torch.randn(2, 4, 4, 4, generator=g)
    flow = create_flow()
    dropped = flow.training_losses(model, x, t, cond.batch_kwargs(batch, torch.tensor([1, 0]), CPU), noise)["loss"]
    kept = flow.training_losses(model, x, t, cond.batch_kwargs(batch, None, CPU), noise)["loss"]
    null_batch = SimpleNamespace(text=null_text.expand(2, -1, -1), text_mask=null_mask.expand(2, -1))
    empty = flow.training_losses(model, x, t, cond.batch_kwargs(null_batch, None, CPU), noise)["loss"]
    # the same rows of other batches: equal up to float32 rounding (padded keys add exact zeros to the softmax)
    assert_close_at_scale(dropped[0], empty[0], rel=64 * 2.0 ** -23)
    assert_close_at_scale(dropped[1], kept[1], rel=64 * 2.0 ** -23)
    assert abs(float(dropped[0].detach() - kept[0].detach())) > 1e-4 * float(kept[0].detach())
    dropped.mean().backward()
    assert model.ctx_embedder.proj.weight.grad.abs().sum() > 0
