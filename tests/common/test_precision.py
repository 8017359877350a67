import torch

from dit_pipeline.common.precision import AUTOCAST_DTYPES, set_tf32


def test_autocast_dtypes():
    assert AUTOCAST_DTYPES == {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def test_set_tf32_round_trip():
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        set_tf32(True)
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("tf32", "tf32")
        set_tf32(False)
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("ieee", "ieee")
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
