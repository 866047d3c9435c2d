"""The judge: the one tolerance policy, the verdicts it returns and the stage and routing decisions."""
