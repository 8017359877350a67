import pytest
import torch

from dit_pipeline.common.precision import AUTOCAST_DTYPES, set_tf32


def test_autocast_dtypes():
    assert AUTOCAST_DTYPES == {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"),
                    reason="older torch has only the legacy allow_tf32 flags (tested below)")
def test_set_tf32_round_trip():
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        set_tf32(True)
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("tf32", "tf32")
        set_tf32(False)
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("ieee", "ieee")
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


@pytest.mark.skipif(hasattr(torch.backends.cuda.matmul, "fp32_precision"),
                    reason="this torch has the fp32_precision API (tested above)")
def test_set_tf32_legacy_flags():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        set_tf32(True)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)
        set_tf32(False)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
