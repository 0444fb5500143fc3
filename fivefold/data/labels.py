"""The label a target position carries when the loss must skip it: a prompt's tokens in supervised
fine-tuning, padding, a window's last position. torch's cross_entropy skips it by default (-100)."""

IGNORE_INDEX = -100
