"""pFedKDH on MNIST, α = 0.1, method.md Table 1 (the foundation issue's target run).

    pfedkdh run --config experiments/configs/mnist_paper.py --data-dir ../shared/data/tfds
"""


def get_config(smoke: bool = False) -> dict:
    cfg = dict(dataset="mnist", alpha=0.1, method="pfedkdh", num_clients=20, participation=0.5,
               rounds=50, local_epochs=2, batch_size=64, lr=0.015, aux_size=5000)
    if smoke:
        cfg.update(rounds=2, local_epochs=1)
    return cfg
