"""Development tools: the local control plane, the real node, images, the demo, chaos, the benchmarks.

The control plane is built from Go modules. This package lives outside `operator/`: it is in
neither the wheel nor the image, and `make venv` installs it into the development virtualenv.

Rule: may use every layer of tasklease; tasklease never imports it (tests do).
"""
