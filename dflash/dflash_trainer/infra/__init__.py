"""Process services every stage uses: files written atomically, the model hub offline, the console,
progress lines and TensorBoard, the GC pause during imports, the note for an environment without bytecode, the GPU
clock sampler, dtype names."""
