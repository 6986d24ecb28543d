"""Task entrypoints (classification, image generation, video generation, language) and the shared harness."""
