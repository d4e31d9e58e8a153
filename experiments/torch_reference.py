"""A PyTorch reference for the CPU benchmark: the same CNN and the same FedPer local training.

It is the work a researcher runs today with a PyTorch FL library (a sequential loop over clients,
one ``DataLoader`` per client and round), written here so that both sides of
``experiments/cpu_vs_torch.py`` do identical work on identical client data:

* the CNN of method.md §1: Conv 5×5·32 (VALID) → MaxPool 2 → ReLU → Conv 5×5·64 → MaxPool 2 → ReLU →
  Dropout → Flatten → Dense 512 → ReLU, then the linear head (PyTorch's NCHW layout);
* local training: SGD (lr 0.015, no momentum), batch 64, a fresh shuffle every epoch, the last
  partial batch kept (``drop_last=False``), E epochs over the client's train split;
* a FedPer round: every client starts from the global backbone and its own persistent head, trains
  both, uploads the backbone; the server averages the backbones weighted by n_k.

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
                lr: float = 0.015, generator: torch.Generator | None = None) -> int:
    """E epochs of SGD through a ``DataLoader`` (shuffled, last partial batch kept); returns the steps."""
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size,
                                         shuffle=True, drop_last=False, generator=generator)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    steps = 0
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            loss_fn(model(xb), yb).backward()
            opt.step()
            steps += 1
    return steps


class FedPerReference:
    """FedPer with persistent heads, one client after another (the PyTorch libraries' loop)."""

    def __init__(self, num_classes: int, channels: int, side: int, clients, seed: int = 0):
        torch.manual_seed(seed)
        self.model = TorchCNN(num_classes, channels, side)
        self.clients = clients  # [(x, y)], one per client
        self.heads = [copy.deepcopy(self.model.head.state_dict()) for _ in clients]
        self.generator = torch.Generator().manual_seed(seed)

    def round(self, selected, epochs: int) -> int:
        """One round over ``selected``; returns the local steps taken."""
        global_backbone = copy.deepcopy(self.model.backbone.state_dict())
        uploads, weights, steps = [], [], 0
        for k in selected:
            x, y = self.clients[k]
            self.model.backbone.load_state_dict(global_backbone)
            self.model.head.load_state_dict(self.heads[k])
            steps += local_train(self.model, x, y, epochs=epochs, generator=self.generator)
            uploads.append(copy.deepcopy(self.model.backbone.state_dict()))
            self.heads[k] = copy.deepcopy(self.model.head.state_dict())
            weights.append(len(y))
        w = torch.tensor(weights, dtype=torch.float32)
        w = w / w.sum()
        avg = {name: sum(wi * u[name] for wi, u in zip(w, uploads)) for name in global_backbone}
        self.model.backbone.load_state_dict(avg)
        return steps
