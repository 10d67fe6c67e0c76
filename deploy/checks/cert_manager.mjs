// Validates cert-manager objects (a JSON list, written by validate_chart.py) against
// cert-manager's own API schema, as compiled from its Go types by @kubernetes-models/cert-manager
// (deploy/checks/package-lock.json pins it). Types, enums and required fields are checked;
// unknown fields are not (those validators allow them).
import { readFileSync } from "node:fs";
import * as v1 from "@kubernetes-models/cert-manager/cert-manager.io/v1";

const objects = JSON.parse(readFileSync(process.argv[2], "utf8"));
let failures = 0;
for (const obj of objects) {
  const Model = obj.apiVersion === "cert-manager.io/v1" ? v1[obj.kind] : undefined;
  const what = `${obj.kind}/${obj.metadata?.name}`;
  if (!Model) {
    console.error(`cert_manager.mjs: ${what}: no schema for ${obj.apiVersion} ${obj.kind}`);
    failures++;
    continue;
  }
  try {
    new Model(obj).validate();
  } catch (e) {
    console.error(`cert_manager.mjs: ${what}: ${e.message}`);
    failures++;
  }
}
console.log(`${objects.length - failures} of ${objects.length} cert-manager objects valid against cert-manager.io/v1`);
process.exit(failures ? 1 : 0);
