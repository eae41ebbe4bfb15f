# PyTorch Lightning under warden: run it under an agent (`warden run -- python lightning_example.py`);
# a second run resumes from the tier. EXAMPLE_STEPS: optimizer steps to train (default 200).
import os

import pytorch_lightning as pl  # or: import lightning.pytorch as pl
import torch

import warden
from warden.integrations.lightning import WardenCallback, restore_path


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(32, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def train():
    x = torch.randn(4096, 32)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True)
    steps = int(os.environ.get("EXAMPLE_STEPS", "200"))
    trainer = pl.Trainer(max_steps=steps, callbacks=[WardenCallback(every_n_steps=50)])
    ckpt_path = restore_path()  # the tier's newest checkpoint; None on a fresh start
    print("resuming from", ckpt_path)
    trainer.fit(Model(), loader, ckpt_path=ckpt_path)


warden.run(train)  # an in-process restart runs train() again: a new Trainer, resumed from the tier
