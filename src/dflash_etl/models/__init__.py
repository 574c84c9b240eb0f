"""The model side: targets, the DFlash drafter, acceptance length, the tiny random target."""
