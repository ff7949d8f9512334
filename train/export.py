"""`python -m train.export`: the documented command, kept; the code lives in `train.serve.export`."""

from train.serve.export import main

if __name__ == "__main__":
    raise SystemExit(main())
