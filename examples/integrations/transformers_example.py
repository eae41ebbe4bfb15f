# Hugging Face Transformers under warden: run it under an agent
# (`warden run -- python transformers_example.py`); a second run resumes from the tier. EXAMPLE_STEPS: optimizer steps to train (default 200).
import os

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

import warden
from warden.integrations.transformers import WardenCallback, restore_dir


class Toy(torch.utils.data.Dataset):
    """Random token ids, labelled by the parity of their sum."""

    def __init__(self, n=512):
        self.ids = torch.randint(1, 100, (n, 16))
        self.labels = self.ids.sum(1) % 2

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def train():
    # A tiny BERT from its config, nothing downloaded; AutoModel*.from_pretrained(...) works the same.
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, num_labels=2)
    args = TrainingArguments(output_dir="out", max_steps=int(os.environ.get("EXAMPLE_STEPS", "200")),
                             save_strategy="steps", save_steps=50, per_device_train_batch_size=8,
                             gradient_accumulation_steps=2, report_to=[])
    trainer = Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=Toy(),
                      callbacks=[WardenCallback()])
    resume = restore_dir(args.output_dir)  # the tier's newest checkpoint, unpacked; None on a fresh start
    print("resuming from", resume)
    trainer.train(resume_from_checkpoint=resume)


warden.run(train)  # an in-process restart runs train() again: a new Trainer, resumed from the tier
