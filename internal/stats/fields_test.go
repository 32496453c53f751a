package stats

import (
	"reflect"
	"regexp"
	"strings"
	"testing"
)

// TestFieldsMatchSnapshot: every JSON field of Snapshot and LayerSnapshot
// has exactly one entry in Fields, and every entry names a field.
func TestFieldsMatchSnapshot(t *testing.T) {
	inStruct := map[string]reflect.Type{}
	var walk func(typ reflect.Type, prefix string)
	walk = func(typ reflect.Type, prefix string) {
		for i := range typ.NumField() {
			f := typ.Field(i)
			name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
			if name == "" || name == "-" {
				t.Errorf("Snapshot field %s has no JSON name", f.Name)
				continue
			}
			if name == "layers" && prefix == "" {
				walk(f.Type.Elem(), LayerPrefix) // map[int]LayerSnapshot
				continue
			}
			inStruct[prefix+name] = f.Type
		}
	}
	walk(reflect.TypeFor[Snapshot](), "")

	seen := map[string]bool{}
	for _, f := range Fields {
		if seen[f.Name] {
			t.Errorf("%s: twice in Fields", f.Name)
		}
		seen[f.Name] = true
		if _, ok := inStruct[f.Name]; !ok {
			t.Errorf("Fields describes %s, which Snapshot does not have", f.Name)
		}
	}
	for name := range inStruct {
		if !seen[name] {
			t.Errorf("Snapshot has %s, which Fields does not describe", name)
		}
	}
}

func TestFieldsAreWellFormed(t *testing.T) {
	promName := regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)
	metrics := map[string]string{}
	var groups []string
	for _, f := range Fields {
		if f.Meaning == "" || !strings.HasSuffix(f.Meaning, ".") || f.Label == "" || len(f.Label) > 48 || f.Group == "" {
			t.Errorf("%s: want a one-sentence Meaning, a Label of at most 48 bytes and a Group", f.Name)
		}
		if n := len(groups); n == 0 || groups[n-1] != f.Group {
			for _, g := range groups {
				if g == f.Group {
					t.Errorf("%s: the fields of group %q are not together", f.Name, g)
				}
			}
			groups = append(groups, f.Group)
		}
		if (f.Kind == Info) != (f.Metric == "") || (f.Kind == Info) != (f.Unit == "") {
			t.Errorf("%s: Info fields, and only they, have no metric and no unit", f.Name)
		}
		if f.Metric == "" {
			continue
		}
		if !promName.MatchString(f.Metric) || (f.Kind == Counter) != strings.HasSuffix(f.Metric, "_total") {
			t.Errorf("%s: metric %q: counters, and only counters, end in _total", f.Name, f.Metric)
		}
		if other, dup := metrics[f.Metric]; dup {
			t.Errorf("%s and %s share the metric %s", other, f.Name, f.Metric)
		}
		metrics[f.Metric] = f.Name
	}
}

func TestValue(t *testing.T) {
	var c Counters
	c.SetLayers([]int{2})
	c.HintRows.Add(7)
	c.CachePinned.Store(true)
	c.Layer(2).Refaulted.Add(3)
	c.ReadEngine = "pread"
	c.SetFuseTransport("uring")
	s := c.Snapshot()
	for name, want := range map[string]any{"hint_rows": uint64(7), "cache_pinned": true, "read_engine": "pread", "fuse_transport": "uring",
		"cache_mode": "pinned", "cache_used_bytes": int64(0), LayerPrefix + "refaulted": uint64(3)} {
		f, ok := FieldByName(name)
		if !ok {
			t.Fatalf("no field %s", name)
		}
		if got := s.Value(f, 2); got != want {
			t.Errorf("Value(%s) = %#v, want %#v", name, got, want)
		}
	}
	if f, _ := FieldByName(LayerPrefix + "pushed"); s.Value(f, 5) != nil {
		t.Errorf("Value of layer 5, which the model lacks, is not nil")
	}
}
