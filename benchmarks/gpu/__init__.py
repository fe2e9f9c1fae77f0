"""One GPU: training and decoding at the WMT-base shape in one call, a step's profile and its bytes moved."""
