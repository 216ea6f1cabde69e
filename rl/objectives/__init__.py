"""What a batch is trained toward: advantage estimators (`advantages`), objectives
(`losses`: GRPO and its family, one signature, one registry) and the off-policy corrections
they compose (`corrections`: TIS, MIS, M2PO, SAT, VCPO, mu-GRPO's veto)."""
