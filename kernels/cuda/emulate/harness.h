// What the harnesses (NAME_test.cpp) share besides the emulation itself.
#pragma once
#include <algorithm>
#include <cmath>

// The larger of two errors, NaN winning: an output never written (the harnesses fill outputs
// with NaN first) or computed from garbage then fails its check, where std::max would drop it.
inline double worse(double worst, double err) {
    return std::isnan(worst) || std::isnan(err) ? NAN : std::max(worst, err);
}
