"""`python -m train.specdecode`: the documented command, kept; the code lives in `train.serve.specdecode`."""

from train.serve.specdecode import main

if __name__ == "__main__":
    raise SystemExit(main())
