"""The dtype names the config takes (target.dtype, drafter dtype, --dtype) and the torch dtypes they mean."""

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
