package main

import (
	"errors"
	"flag"
	"io"
	"testing"

	"github.com/engramfs/engramfs/backing"
)

func TestOpenSourcePicksByURL(t *testing.T) {
	parse := func(args ...string) mountFlags {
		fl := flag.NewFlagSet("mount", flag.ContinueOnError)
		fl.SetOutput(io.Discard)
		var mf mountFlags
		mf.register(fl)
		if err := fl.Parse(args); err != nil {
			t.Fatal(err)
		}
		return mf
	}
	dir := t.TempDir()
	src, err := openSource(dir, parse(), nil, nil)
	if _, ok := src.(*backing.LocalSource); err != nil || !ok {
		t.Fatalf("openSource(%s) = %T, %v; want a local source", dir, src, err)
	}
	var ue usageError
	if _, err := openSource(dir, parse("--s3-endpoint", "http://127.0.0.1:1"), nil, nil); !errors.As(err, &ue) {
		t.Errorf("--s3-endpoint with a directory: %v, want a usage error", err)
	}
	if _, err := openSource("s3://", parse(), nil, nil); !errors.As(err, &ue) {
		t.Errorf("s3:// without a bucket: %v, want a usage error", err)
	}
	if mf := parse("--s3-path-style=false"); !mf.s3PathStyle.set || mf.s3PathStyle.value {
		t.Errorf("--s3-path-style=false parsed to %+v", mf.s3PathStyle)
	}
	if mf := parse("--s3-path-style"); !mf.s3PathStyle.set || !mf.s3PathStyle.value {
		t.Errorf("--s3-path-style parsed to %+v", mf.s3PathStyle)
	}
}
