"""What the training mix keeps out, beyond exact duplicates: benchmark items (contamination)."""
