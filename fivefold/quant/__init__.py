"""Post-training weight quantization: int8 / int4 round-to-nearest and GPTQ (formats.py, gptq.py), inference
with the codes (linear.py), a quantized model directory (checkpoint.py: its layout), `fivefold quantize`
(commands.py)."""
