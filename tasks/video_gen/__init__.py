"""Video generation (MHLA Table 5): Wan2.1 fine-tuning with flow matching, sampling, and the CPU mini task."""
