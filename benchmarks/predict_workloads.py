"""The workloads of bench_predict.py and tests/core/test_predict_gpu.py: a set-up cell and a step cell each.

Each set-up makes its tensors on ``device`` (a name the cells see); ``bs`` is the batch, set before the
step so that a batch search can vary it. ``warm`` steps run for real before the measured one (a later step,
when optimizer state and cached segments exist).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["WORKLOADS", "Workload"]


class Workload(NamedTuple):
    name: str
    setup: str
    step: str
    bs: int
    warm: int = 0  # real steps before the predicted one


_MLP = """
import torch
torch.manual_seed(0)
layers = []
for _ in range(8):
    layers += [torch.nn.Linear(4096, 4096), torch.nn.GELU()]
model = torch.nn.Sequential(*layers).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
"""

_MLP_STEP = """
x = torch.randn(bs, 4096, device=device)
loss = model(x).float().pow(2).mean()
loss.backward()
opt.step()
opt.zero_grad(set_to_none=True)
"""

_CONV = """
import torch
torch.manual_seed(0)
def block(cin, cout):
    return [torch.nn.Conv2d(cin, cout, 3, padding=1, bias=False), torch.nn.BatchNorm2d(cout), torch.nn.ReLU()]
model = torch.nn.Sequential(*block(3, 64), *block(64, 128), torch.nn.MaxPool2d(2), *block(128, 256),
                            *block(256, 256), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                            torch.nn.Linear(256, 1000)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
"""

_CONV_STEP = """
x = torch.randn(bs, 3, 128, 128, device=device)
y = torch.randint(0, 1000, (bs,), device=device)
loss = torch.nn.functional.cross_entropy(model(x), y)
loss.backward()
opt.step()
opt.zero_grad(set_to_none=True)
"""

_ENCODER = """
import torch
torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True, dropout=0.0)
model = torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
scaler = torch.amp.GradScaler(device)
"""

_ENCODER_STEP = """
x = torch.randn(bs, 512, 1024, device=device)
with torch.autocast(device, dtype=torch.bfloat16):
    loss = model(x).float().pow(2).mean()
scaler.scale(loss).backward()
scaler.step(opt)
scaler.update()
opt.zero_grad(set_to_none=True)
"""

_ENCODER_CHECKPOINT_STEP = """
from torch.utils.checkpoint import checkpoint
x = torch.randn(bs, 512, 1024, device=device)
with torch.autocast(device, dtype=torch.bfloat16):
    h = x
    for encoder_layer in model.layers:
        h = checkpoint(encoder_layer, h, use_reentrant=False)
    loss = h.float().pow(2).mean()
scaler.scale(loss).backward()
scaler.step(opt)
scaler.update()
opt.zero_grad(set_to_none=True)
"""

_TEMPORARY = """
import torch
torch.manual_seed(0)
w = torch.randn(8192, 8192, device=device)
"""

_TEMPORARY_STEP = """
big = torch.empty(bs, 1024, 1024, 128, device=device)  # bs x 512 MiB, freed below
big.fill_(1.0)
total = big.sum()
del big
result = w @ w + total
"""

_THREE_STEPS = _MLP_STEP.replace("\n", "\n    ").replace("\n    x = ", "for step in range(3):\n    x = ", 1)

WORKLOADS = (
    Workload("mlp_adamw_first_step", _MLP, _MLP_STEP, 256),
    Workload("mlp_adamw_later_step", _MLP, _MLP_STEP, 256, warm=1),
    Workload("conv_batchnorm", _CONV, _CONV_STEP, 64),
    Workload("encoder_bf16_gradscaler", _ENCODER, _ENCODER_STEP, 8),
    Workload("encoder_bf16_checkpointed", _ENCODER, _ENCODER_CHECKPOINT_STEP, 8),
    Workload("large_temporary", _TEMPORARY, _TEMPORARY_STEP, 4),
    Workload("mlp_three_steps", _MLP, _THREE_STEPS, 256),
)
