"""`python -m prove_local.train --out runs/embedded`: train and export the embedded MARS proposer / verifier pair."""
from .pipeline import main

if __name__ == "__main__":
    main()
