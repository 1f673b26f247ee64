"""Drafter training: data pipeline (data, encode, batching), regeneration of assistant turns with
the target, and the DFlash drafter trainer (anchors, masks, loss, forward, trainer, checkpoint)."""
