"""A PyTorch reference for the CPU benchmark: the same CNN and the same FedPer local training.

It is the work a researcher runs today with a PyTorch FL library (a sequential loop over clients,
one ``DataLoader`` per client and round), written here so that both sides of
``experiments/cpu_vs_torch.py`` do identical work on identical client data:

* the CNN of method.md §1: Conv 5×5·32 (VALID) → MaxPool 2 → ReLU → Conv 5×5·64 → MaxPool 2 → ReLU →
  Dropout → Flatten → Dense 512 → ReLU, then the linear head (PyTorch's NCHW layout);
* local training: SGD (lr 0.015, no momentum), batch 64, a fresh shuffle every epoch, the last
  partial batch kept (``drop_last=False``), E epochs over the client's train split;
* a FedPer round: every client starts from the global backbone and its own persistent head, trains
  both, uploads the backbone; the server averages the backbones weighted by n_k; a FedAvg round
  (``personal_heads=False``): every client starts from the whole global model, and the server averages
  whole models.

On a GPU (``device="cuda"``) it does what the PyTorch FL libraries do: the model and the averaging on
the device, each client's data in host memory, every batch of the ``DataLoader`` moved to the device.

Needs PyTorch (``pip install -e '.[bench]'``); the library and its tests never import this file.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn


class TorchCNN(nn.Module):
    def __init__(self, num_classes: int, channels: int, side: int, dropout: float = 0.0):
        super().__init__()
        flat = 64 * (((side - 4) // 2 - 4) // 2) ** 2  # 1024 for 28×28, 1600 for 32×32
        self.backbone = nn.Sequential(
            nn.Conv2d(channels, 32, 5), nn.MaxPool2d(2), nn.ReLU(),
            nn.Conv2d(32, 64, 5), nn.MaxPool2d(2), nn.ReLU(),
            nn.Dropout(dropout), nn.Flatten(), nn.Linear(flat, 512), nn.ReLU())
        self.head = nn.Linear(512, num_classes)

    def forward(self, x):
        return self.head(self.backbone(x))


def client_tensors(images: np.ndarray, labels: np.ndarray, idx: np.ndarray):
    """A client's train split as normalised NCHW float tensors (as a dataset transform makes them)."""
    x = torch.from_numpy(((images[idx].astype(np.float32) / 255.0) - 0.5) / 0.5).permute(0, 3, 1, 2)
    return x.contiguous(), torch.from_numpy(labels[idx].astype(np.int64))


def local_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int, batch_size: int = 64,
                lr: float = 0.015, generator: torch.Generator | None = None, device: str = "cpu") -> int:
    """E epochs of SGD through a ``DataLoader`` (shuffled, last partial batch kept), each batch moved
    to ``device`` (the model's); returns the steps."""
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size,
                                         shuffle=True, drop_last=False, generator=generator)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    steps = 0
    for _ in range(epochs):
        for xb, yb in loader:
            if device != "cpu":
                xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            opt.zero_grad()
            loss_fn(model(xb), yb).backward()
            opt.step()
            steps += 1
    return steps


class FedPerReference:
    """FedPer with persistent heads (or FedAvg: ``personal_heads=False``), one client after another
    (the PyTorch libraries' loop), the model on ``device``."""

    def __init__(self, num_classes: int, channels: int, side: int, clients, seed: int = 0, *,
                 personal_heads: bool = True, device: str = "cpu"):
        torch.manual_seed(seed)
        self.device, self.personal_heads = device, personal_heads
        self.model = TorchCNN(num_classes, channels, side).to(device)
        self.clients = clients  # [(x, y)], one per client, in host memory
        self.heads = [copy.deepcopy(self.model.head.state_dict()) for _ in clients] if personal_heads else None
        self.generator = torch.Generator().manual_seed(seed)

    def round(self, selected, epochs: int) -> int:
        """One round over ``selected``; returns the local steps taken (the device's work is queued:
        ``torch.cuda.synchronize()`` to wait for it)."""
        shared = self.model.backbone if self.personal_heads else self.model
        global_state = copy.deepcopy(shared.state_dict())
        uploads, weights, steps = [], [], 0
        for k in selected:
            x, y = self.clients[k]
            shared.load_state_dict(global_state)
            if self.personal_heads:
                self.model.head.load_state_dict(self.heads[k])
            steps += local_train(self.model, x, y, epochs=epochs, generator=self.generator, device=self.device)
            uploads.append(copy.deepcopy(shared.state_dict()))
            if self.personal_heads:
                self.heads[k] = copy.deepcopy(self.model.head.state_dict())
            weights.append(len(y))
        w = torch.tensor(weights, dtype=torch.float32, device=self.device)
        w = w / w.sum()
        avg = {name: sum(wi * u[name] for wi, u in zip(w, uploads)) for name in global_state}
        shared.load_state_dict(avg)
        return steps
