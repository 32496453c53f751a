//go:build race

package testenv

// RaceEnabled says whether the tests (and so the binaries built for them)
// run with the race detector.
const RaceEnabled = true
